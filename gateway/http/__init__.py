"""HTTP: the Litestar app (app.py), its request and response types (schemas.py), API keys
(auth.py), and the OpenAPI schema made to say what the server does (openapi.py)."""
