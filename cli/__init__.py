"""`infctl`, the command line over the cluster's client library."""
