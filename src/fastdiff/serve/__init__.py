"""``fastdiff serve``: an HTTP image service that batches concurrent requests onto one pipeline.

``fastdiff.serve.app.create_app`` builds the FastAPI app (``POST /v1/images``, ``GET /v1/model``, ``/health``,
``/metrics`` and a browser page at ``/``); ``batcher`` forms the batches, ``schema`` validates requests,
``metrics`` renders Prometheus text and ``loadtest`` drives a running server. FastAPI, uvicorn and httpx come with
the ``serve`` extra: ``pip install 'fastdiff[serve]'``.
"""
