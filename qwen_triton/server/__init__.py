"""`qwen-triton serve`: an OpenAI-compatible HTTP server with continuous batching.

The files, in the order a request meets them:
- protocol.py: the wire format (pydantic requests, with every parameter's range; responses; OpenAI's errors);
- app.py: the FastAPI app (`create_app(llm)`): routes, tokenizing, assembling responses and SSE streams;
- detokenizer.py: generated ids to text, holding back partial characters and partial stop strings;
- sequence.py: one prompt-and-choice's state, and what a step sends back for it;
- scheduler.py: the engine thread, continuous batching over the backend's slots, batched and chunked prefill;
- sampler.py: the next id of each sequence, chosen on the device inside the decode step (triton backend) or on the
  host from the logits (reference backend);
- metrics.py: Prometheus text;
- runner.py: uvicorn, in the foreground (SIGTERM drains) or on a thread.

FastAPI and uvicorn come with the `serve` extra: pip install 'qwen-triton[serve]'.
"""
