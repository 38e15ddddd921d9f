"""The OpenAI Responses API (/v1/responses) on the chat generation path: routes.py."""
