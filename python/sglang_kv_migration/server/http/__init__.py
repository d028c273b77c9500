"""The HTTP side, in the tokenizer manager's process: the six FastAPI routes
(`routes.py`), the innermost ASGI middleware that answers well-formed requests to them
without Starlette's router (`fast_path.py`), and the communicators that carry each request
to every scheduler rank and gather the replies (`communicators.py`)."""
