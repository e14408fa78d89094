"""Ray Serve: the OpenAI-compatible app (app.py) as a deployment's ingress, each replica opening its own engine.

    serve run dflash_onnx.serving.ray_serve:app_builder directory=DIR [max_batch=4 max_queue=16 num_replicas=2
    model=NAME ...]

or from Python, `serve.run(deployment(EngineSettings(DIR), ServerOptions(model="name")))`. A replica serves what
`dflash-onnx serve` serves (the same routes, errors, batching and tokens); Ray adds the replicas and the routing
between them. Each replica's engine queues up to max_queue requests and answers 429 beyond, so Ray is told to
hand a replica that many at once (max_ongoing_requests) instead of holding them in its own router.
"""

from __future__ import annotations

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.serving.app import ServerOptions, create_app
from dflash_onnx.serving.host import EngineSettings

SERVER_KEYS = ("model", "api_key", "max_tokens", "max_body_bytes", "temperature")
DEPLOYMENT_KEYS = ("num_replicas", "num_cpus")


def _serve_module():
    try:
        from ray import serve
    except ModuleNotFoundError:
        raise DFlashError("hosting on Ray Serve needs ray[serve], which is not installed: "
                          "pip install 'dflash-onnx[ray]'") from None
    return serve


def deployment(settings: EngineSettings, options: ServerOptions, num_replicas: int = 1,
               num_cpus: float | None = None):
    """A Ray Serve application: `num_replicas` replicas, each with an engine opened by `settings` (in the replica's
    process, when it starts) behind the FastAPI app. The settings are checked here, in the driver, so a typo fails
    at once rather than in a replica's log."""
    serve = _serve_module()
    settings.check()
    if num_replicas < 1:
        raise DFlashError(f"num_replicas must be at least 1, got {num_replicas}")

    def build_app():
        return create_app(settings.open(), options)

    @serve.deployment(name="dflash-onnx", num_replicas=num_replicas,
                      max_ongoing_requests=settings.max_queue + settings.max_batch,
                      ray_actor_options={} if num_cpus is None else {"num_cpus": num_cpus})
    @serve.ingress(build_app)
    class DFlashServer:
        """One replica: the app build_app returns, over the engine it opened."""

    return DFlashServer.bind()


def app_builder(args: dict[str, str]):
    """`serve run dflash_onnx.serving.ray_serve:app_builder key=value ...`: the engine's settings (EngineSettings'
    fields,
    `directory` required), the server's (model, api_key, max_tokens, max_body_bytes, temperature) and the
    deployment's (num_replicas, num_cpus), as strings."""
    args = dict(args)
    server = {key: args.pop(key) for key in SERVER_KEYS if key in args}
    placement = {key: args.pop(key) for key in DEPLOYMENT_KEYS if key in args}
    settings = EngineSettings.from_strings(args)
    try:
        options = ServerOptions(model=server.get("model") or settings.directory.resolve().name,
                                api_key=server.get("api_key") or None,
                                max_body_bytes=int(server.get("max_body_bytes", 1 << 20)),
                                max_tokens=int(server.get("max_tokens", 512)),
                                temperature=float(server.get("temperature", 0.0)))
        num_replicas = int(placement.get("num_replicas", 1))
        num_cpus = float(placement["num_cpus"]) if "num_cpus" in placement else None
    except ValueError as exc:
        raise DFlashError(f"a server or deployment setting is not a number: {exc}") from None
    return deployment(settings, options, num_replicas, num_cpus)
