"""The model runner: a Llama-family decoder over paged, distributable KV."""
