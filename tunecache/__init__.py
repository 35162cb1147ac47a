"""tunecache."""
