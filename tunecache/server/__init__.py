"""The fleet service: FastAPI over the store."""
