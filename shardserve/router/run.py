"""`shardserve router`: load and check the config, load the embedding model if a signal needs it,
serve the router app with uvicorn."""
from __future__ import annotations

import logging

from shardserve.router.config import load_config
from shardserve.router.signals import Embedder, SignalEvaluator

logger = logging.getLogger("shardserve")


def run_router(config_path: str, host: str = "0.0.0.0", port: int = 9000, api_key: str | None = None) -> int:
    import uvicorn

    from shardserve.router.app import build_router_app
    config = load_config(config_path)   # a ConfigError names the YAML path at fault
    needs_embeddings = any(s.type == "embedding" for d in config.decisions for s in d.signals)
    evaluator = SignalEvaluator(Embedder() if needs_embeddings else None)
    app = build_router_app(config, api_key, evaluator)
    logger.info("router on http://%s:%d: models %s, %d backends, %d decisions", host, port,
                ", ".join(config.models), len(config.backends), len(config.decisions))
    uvicorn.run(app, host=host, port=port, log_level="info", access_log=False)
    return 0
