"""The fleet service: FastAPI over the store (`tunecache serve`, or `create_app()`)."""
