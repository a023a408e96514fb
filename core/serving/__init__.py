"""Serving: an asynchronous engine (``async_engine``; its thread ``engine_thread``, the
torchrun followers ``lockstep``) and the OpenAI-compatible HTTP server over it (``app``:
routes; ``body``: the request body read and decoded; ``protocol``: request parsing, with
``messages``, ``structured`` (response_format, guided_*) and ``tool_calls/`` (tools,
tool_choice, the model's calls read back); ``openai_errors``: the error shape;
``prompts``: prompts as token ids, off the event loop; ``responses``: response shapes;
``fanout``: n choices as one stream; ``metrics``: Prometheus; ``static/``: the chat page).
The server's modules need the ``serve`` extra (FastAPI, uvicorn, prometheus-client);
``body``, ``protocol`` and what it reads with, ``prompts`` and ``responses`` need nothing
beyond the core (structured output: the ``structured`` extra)."""
