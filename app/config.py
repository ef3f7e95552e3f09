"""The server's settings, in one dataclass with commented defaults. Every limit has a name.

Each setting, and each field of the engine's EngineConfig, can be set from the command line
(`python -m app --setting max_connections 32`) or the environment (`SENDLENS_MAX_CONNECTIONS=32`),
as datasette does with `--setting`. docs/settings.md lists them all (a test checks it).
"""

import os
import re
from dataclasses import MISSING, dataclass, field, fields, replace

from core.config import EngineConfig, WeightFormat
from core.errors import InvalidParameter, is_int

from .clients import parse_networks

ENV_PREFIX = "SENDLENS_"

# Engine settings whose server default differs from the library's (core.config.EngineConfig).
# q4_1 multiplies by the GGUF file's own 4-bit weights: a chat decodes ~8x faster than in fp32,
# and the looking-inside widgets still run the same weights in fp32 (LLMEngine.reference_model).
SERVER_ENGINE_DEFAULTS = {"weight_format": WeightFormat.Q4_1}


@dataclass
class ServerConfig:
    model: str = "smollm2-135m"           # a name from toy_models
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(**SERVER_ENGINE_DEFAULTS))  # `model` from above
    # -- connections --
    max_connections: int = 64             # websocket clients at once (a classroom)
    max_connections_per_address: int = 16  # ... from one client address (forty tabs get 16)
    max_message_bytes: int = 64 * 1024    # one client message (a websocket text frame)
    max_messages_per_second: int = 20     # client messages per second per connection (bursts of 2x)
    max_outbox_bytes: int = 16 * 1024 * 1024  # replies waiting for a client that does not read; then cut off
    idle_timeout_s: int = 900             # a connection with nothing in flight and silent this long is closed
    ping_interval_s: int = 25             # websocket pings; a peer that misses one is cut off
    # -- work per connection --
    max_requests_per_connection: int = 4  # generate requests in flight per client
    max_jobs_per_connection: int = 4      # widget jobs (attention, probes, experiments) in flight per client
    # -- work per connection, priced in tokens (app/budget.py) --
    work_tokens_per_second: int = 2048    # a connection's budget of work: tokenized, prompt and stop-check tokens a second
    work_burst_tokens: int = 16384        # ... held at most (one large message; then its debt is paid off)
    work_slice_tokens: int = 512          # template/tokenize work and prompts above this run as a job, in slices of this many tokens
    job_slice_tokens: int = 16            # what one slice of a widget job costs its connection
    # -- the engine's queues --
    max_queue: int = 256                  # requests waiting for the engine before "overloaded"
    max_queued_tokens: int = 64 * 1024    # prompt tokens waiting for the engine before "overloaded"
    max_tokens_per_connection: int = 16 * 1024  # prompt tokens of one connection's requests in flight (fair share)
    max_queued_jobs: int = 64             # widget jobs in the runner at once, all clients together
    job_cache_entries: int = 128          # widget results kept by their inputs (a classroom computes once)
    max_worker_processes: int = 4         # processes the parallelism widgets' jobs may run at once, all jobs together
    worker_timeout_s: int = 120           # a worker group still running after this long is killed
    # -- what one request may ask --
    max_messages: int = 200               # messages in one chat transcript
    max_tokens_limit: int = 1024          # the most max_tokens a client may ask for
    max_samples: int = 8                  # the most samples (n) one generate request may ask for
    max_beam_width: int = 4               # the most beams (beam_width) one generate request may ask for
    default_max_tokens: int = 256         # when a generate request does not say
    max_inspect_tokens: int = 1024        # longest text the looking-inside widgets take (tokens)
    # -- who may use it --
    trusted_hosts: str = ""               # extra Host names (space-separated) besides localhost forms and this machine's
    allowed_origins: str = ""             # extra page origins (space-separated) that may open the websocket
    frame_ancestors: str = "*"            # who may put /embed/ pages in an iframe (CSP)
    # -- classroom rooms (app/rooms) --
    room_max_students: int = 60           # students who may join one room
    room_max_rooms: int = 8               # rooms open at once
    room_max_requests_per_student: int = 100  # generate requests one student may send in a room
    room_join_rate_per_minute: int = 120  # join attempts per client address per minute (a class behind one NAT)
    room_idle_close_s: int = 4 * 3600     # a room with no request and no watcher this long is closed
    room_kv_blocks: int = 512             # KV blocks of one room's engine (block_size tokens each)
    rooms_db_path: str = ""               # the rooms' SQLite file; empty: <cache dir>/rooms.sqlite3
    trusted_proxies: str = ""             # proxies (addresses or networks, space-separated) whose forwarded headers are believed
    client_address_header: str = "X-Forwarded-For"  # the header a trusted proxy names the client's address in
    # -- replicas behind a balancer (app/replicas.py, app/shared, docs/deploy.md) --
    replica_id: str = ""                  # this replica's number, 1 to 31 (its rooms' codes start with its symbol); empty: a server alone
    redis_url: str = ""                   # the Redis the replicas share (job results, seats, rooms' routes); empty: all in this process
    shared_lease_s: int = 15              # a replica's seats in Redis stop counting this long after it stops renewing its lease
    shared_cache_ttl_s: int = 3600        # a job result stays in the shared cache this long
    # -- pages --
    bench_results: str = "bench/results/latest.json"  # the benchmark's JSON shown at /benchmark (relative: to the project root)
    recordings_dir: str = ""              # recordings an embed falls back on (python -m app.export's DIR/recordings); empty: none
    testing: bool = False

    def __post_init__(self):
        self.engine = replace(self.engine, model=self.model)  # a copy: the caller's is not changed
        if not isinstance(self.frame_ancestors, str) or not self.frame_ancestors.strip() or any(
                c in self.frame_ancestors for c in ";,\r\n"):
            raise InvalidParameter("frame_ancestors", "must be a CSP source list such as * or "
                                   "'self' https://example.org, without ; , or line breaks")
        for name in ("trusted_hosts", "allowed_origins"):
            value = getattr(self, name)
            if not isinstance(value, str) or any(c in value for c in ";,\r\n\"'"):
                raise InvalidParameter(name, "must be names separated by spaces")
        try:
            parse_networks(self.trusted_proxies)
        except (ValueError, AttributeError):
            raise InvalidParameter("trusted_proxies", "must be IP addresses or networks (10.0.0.0/8) separated "
                                   f"by spaces, got {self.trusted_proxies!r}") from None
        if not isinstance(self.client_address_header, str) or not re.fullmatch(r"[A-Za-z0-9-]+",
                                                                                 self.client_address_header):
            raise InvalidParameter("client_address_header", "must be an HTTP header name such as X-Forwarded-For")
        from .replicas import replica_number
        replica_number(self.replica_id)   # raises naming replica_id
        if not isinstance(self.redis_url, str) or (self.redis_url and not re.fullmatch(
                r"(redis|rediss|unix)://\S+", self.redis_url)):
            raise InvalidParameter("redis_url", "must be empty (no Redis) or a URL such as redis://127.0.0.1:6379/0, "
                                   f"got {self.redis_url!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type is int or f.type == "int":
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
        engine = EngineConfig(**{**SERVER_ENGINE_DEFAULTS,
                                 **{k: v for k, v in values.items() if k in engine_keys and k != "model"}})
        return cls(engine=engine, **{k: v for k, v in values.items() if k in own and k != "engine"})


def settings() -> dict[str, tuple[type, object]]:
    """Every setting by name -> (type, default): the server's own, then the engine's."""
    out = {}
    for cls in (ServerConfig, EngineConfig):
        for f in fields(cls):
            if f.name in ("engine", "testing") or f.name in out:
                continue
            default = f.default if f.default is not MISSING else f.default_factory()
            if cls is EngineConfig:
                default = SERVER_ENGINE_DEFAULTS.get(f.name, default)
            out[f.name] = (_type_of(f.type), default)
    return out


def _type_of(annotation) -> type:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    for name, t in (("bool", bool), ("int", int), ("float", float)):
        if text.startswith(name):
            return t
    return str


def parse_setting(name: str, text: str):
    """A setting's value from text (command line or environment), checked against its type."""
    known = settings()
    if name not in known:
        raise InvalidParameter(name, "is not a setting (see docs/settings.md)")
    kind, _ = known[name]
    if kind is bool:
        if text.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            raise InvalidParameter(name, f"must be true or false, got {text!r}")
        return text.lower() in ("1", "true", "yes", "on")
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise InvalidParameter(name, f"must be a {kind.__name__}, got {text!r}") from None
    return text


def from_environment(environ=None) -> dict:
    """Settings given as SENDLENS_<NAME> environment variables."""
    environ = os.environ if environ is None else environ
    out = {}
    for name in settings():
        key = ENV_PREFIX + name.upper()
        if key in environ:
            out[name] = parse_setting(name, environ[key])
    return out
