"""Generation: engine.py the embedded engine (continuous batching, decode_step.py its CUDA-graph
step, sampling.py its sampler), service.py / server.py / embedded.py that engine as a service,
an HTTP server and a Ray actor, sglang.py SGLang's server, router.py sglang-router,
manager.py the engines behind the router (health, replacement, weight updates via
updates.py), client.py generation through the router, weights.py / sync.py the weights from
the trainer to the engines, multiturn.py generate functions, serve.py `miles serve`."""
