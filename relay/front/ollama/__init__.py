"""Ollama's API on relay's front (SPEC A10): `relay.front.ollama.routes` answers every
path under ``/api/`` (and ``/`` on ``[server] ollama_port``), `relay.front.ollama.handlers`
runs its chat, generate and embeddings requests. A room of its own beside the front's
other modules (the front holds 16)."""
