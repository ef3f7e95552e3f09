"""The server's settings, in one dataclass with commented defaults. Every limit has a name."""

from dataclasses import dataclass, field, fields, replace

from core.config import EngineConfig
from core.errors import InvalidParameter, is_int


@dataclass
class ServerConfig:
    model: str = "smollm2-135m"           # a name from toy_models
    engine: EngineConfig = field(default_factory=EngineConfig)  # its `model` is set from above
    max_connections: int = 64             # websocket clients at once (a classroom)
    max_requests_per_connection: int = 4  # generate requests in flight per client
    max_jobs_per_connection: int = 4      # widget jobs (attention, probes, experiments) in flight per client
    max_queued_jobs: int = 64             # widget jobs in the runner at once, all clients together
    job_cache_entries: int = 128          # widget results kept by their inputs (a classroom computes once)
    max_messages: int = 200               # messages in one chat transcript
    max_queue: int = 256                  # requests waiting for the engine before "overloaded"
    max_message_bytes: int = 64 * 1024    # one client message (a websocket text frame)
    max_tokens_limit: int = 1024          # the most max_tokens a client may ask for
    default_max_tokens: int = 256         # when a generate request does not say
    max_inspect_tokens: int = 1024        # longest text the looking-inside widgets take (tokens)
    frame_ancestors: str = "*"            # who may put /embed/ pages in an iframe (CSP)
    testing: bool = False

    def __post_init__(self):
        self.engine = replace(self.engine, model=self.model)  # a copy: the caller's is not changed
        if not isinstance(self.frame_ancestors, str) or not self.frame_ancestors.strip() or any(
                c in self.frame_ancestors for c in ";,\r\n"):
            raise InvalidParameter("frame_ancestors", "must be a CSP source list such as * or "
                                   "'self' https://example.org, without ; , or line breaks")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("max_") or f.name in ("default_max_tokens", "job_cache_entries"):
                if not is_int(value) or value < 1:
                    raise InvalidParameter(f.name, f"must be a positive integer, got {value!r}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise InvalidParameter("default_max_tokens", "must not exceed max_tokens_limit")

    @classmethod
    def from_mapping(cls, values: dict) -> "ServerConfig":
        """Build from a dict; keys that are EngineConfig fields go to the engine."""
        own = {f.name for f in fields(cls)}
        engine_keys = {f.name for f in fields(EngineConfig)}
        unknown = set(values) - own - engine_keys
        if unknown:
            raise InvalidParameter(sorted(unknown)[0], "is not a server or engine setting")
        engine = EngineConfig(**{k: v for k, v in values.items() if k in engine_keys and k != "model"})
        return cls(engine=engine, **{k: v for k, v in values.items() if k in own and k != "engine"})
