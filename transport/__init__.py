"""Messages between daemons over UCX, and an in-memory transport for tests."""
