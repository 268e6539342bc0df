"""The instance daemon `infinited`: one model instance, its KV pool and its peers."""
