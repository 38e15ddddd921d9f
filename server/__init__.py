"""HTTP: the app factory, routes, OpenAI protocol structs, SSE and the CLI. No tensors here."""
