"""OpenAI-compatible HTTP serving: `loopserve serve`.

- `protocol.py`: request bodies (pydantic), OpenAI-style errors, the unknown-field policy.
- `api.py`: `build_app(engine, settings, on_engine_dead)`, the FastAPI app around `OpenAIServing`
  (the endpoints), which runs the engine on an `EngineThread` (engine/engine_thread.py: one background thread drives
  `LLMEngine.step()` while the event loop adds, streams and aborts requests).
- `responses.py`: the response pieces completions and chat share (text deltas, logprobs, usage, SSE).
- `middleware.py`: the request body size limit and request ids (`X-Request-Id`).
- `connection.py`: uvicorn's HTTP protocol with a request read timeout (stalled clients get 408).
- `metrics.py`: Prometheus metrics (`loopserve:` prefix, vLLM names plus loop-specific ones).
- `structured.py`: structured output and tool calls of a request (`response_format`, `guided_*`, `tools`).
- `cli.py`: the `serve` subcommand.
- `ray.py`: several engine replicas behind one endpoint on Ray Serve (`serve --replicas N`; imported
  only then; docs/scale-out.md).
"""
