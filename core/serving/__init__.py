"""Serving: an asynchronous engine (``async_engine``; its thread ``engine_thread``, the
torchrun followers ``lockstep``) and the OpenAI-compatible HTTP server over it (``app``:
routes; ``body``: the request body read and decoded; ``protocol``: request parsing;
``prompts``: prompts as token ids, off the event loop; ``responses``: response shapes;
``fanout``: n choices as one stream; ``metrics``: Prometheus; ``static/``: the chat page).
The server's modules need the ``serve`` extra (FastAPI, uvicorn, prometheus-client);
``body``, ``protocol``, ``prompts`` and ``responses`` need nothing beyond the core."""
