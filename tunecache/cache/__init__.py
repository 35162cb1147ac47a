"""The config cache: the one reader and keeper of tuned configs (memory, local store, fleet)."""
