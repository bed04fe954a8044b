"""Configuration of the gateway (one slotted dataclass, validated)."""

from __future__ import annotations

from dataclasses import dataclass, field

from paramstore.config import env_secret


@dataclass(slots=True)
class GatewayConfig:
    """How the gateway listens, admits, routes and retries."""

    host: str = "127.0.0.1"  # bind address; forced to 127.0.0.1 when no API key is configured
    port: int = 8000
    models: list[str] = field(default_factory=list)  # served models, paramstore refs NAME[@vN]; empty: every model in the store
    model: str | None = None  # one served model (older configs, `--model` once): joins `models`
    models_refresh_s: float = 30.0  # with `models` empty: the store's model list is read again this often (and on a miss)
    store: list[str] = field(default_factory=list)  # store locations (empty: the local default)
    api_keys: tuple[str, ...] = ()  # Bearer keys for /v1/*; empty = open, loopback only
    admin_key: str | None = None  # Bearer key for /admin/*; none: the admin API is closed (401) unless admin_open
    admin_open: bool = False  # no admin key: /admin/* open to whoever reaches the gateway (loopback only), warned at start
    internal_token: str | None = None  # signs requests to nodes and checks their proofs (compute/node/auth.py); never sent
    nodes: list[tuple[str, str]] = field(default_factory=list)  # static (role, url) pairs
    max_running: int = 64  # requests in flight to nodes at once
    max_queue: int = 256  # requests waiting for admission; beyond: 429 at once
    queue_timeout_s: float = 30.0  # longest wait before a request starts (admission, then a node); then 429/503
    retry_attempts: int = 3  # extra attempts after a node failure (prefill or decode)
    backoff_base_s: float = 0.05  # exponential backoff base, with full jitter
    backoff_max_s: float = 1.0
    health_interval_s: float = 0.5  # node /load polling period
    health_failures: int = 2  # consecutive failures before a node is evicted
    routing: str = "cache"  # cache: by each node's cached prefix and load (gateway/routing/router.py) | load: load only
    cache_isolation: str = "per_key"  # per_key: each API key's requests share cached KV only among themselves | shared
    # usage.prompt_tokens_details.cached_tokens: "isolated" reports it only where each API key has a cache of its
    # own (keys set, cache_isolation per_key): a shared cache's hit count tells a caller what others sent |
    # "always" (one user's box, benchmarks) | "never"
    report_cached_tokens: str = "isolated"
    prefix_ttl_s: float = 10.0  # a request sent counts as its prompt's blocks on that node this long (before its report)
    # peer pull (routing = cache): a node pulls a prompt's cached prefix from the node holding it when
    # pull_fixed_s + bytes / pull_bytes_per_s < tokens / prefill_tokens_per_s (gateway/routing/router.py PullCost;
    # the defaults measured on a 2-core box: docs/gateway.md, "Peer pull")
    peer_pull: bool = True
    pull_fixed_s: float = 0.045  # an export + transfer's cost whatever its size
    pull_bytes_per_s: float = 0.37e9  # the KV link's rate
    prefill_tokens_per_s: float = 200.0  # a node's prefill rate until /load reports its measured one
    pull_export_timeout_s: float = 2.0  # a holder's export answers within this, or the node computes the prefix
    prepull_chains: int = 4  # a node joining pulls this many of the hottest prefixes from their holders (0: none)
    node_timeout_s: float = 60.0  # longest silence from a node mid-request
    max_model_len: int | None = None  # context limit (default: the model's)
    max_tokens_limit: int | None = None  # most tokens one request may generate: max_tokens' maximum and default
    max_body_bytes: int = 8 << 20  # largest request body on the public API (413 before it is read past this)

    def __post_init__(self) -> None:
        from paramstore.config import parse_ref

        if self.model:
            self.models = [self.model, *self.models]
        self.models = list(dict.fromkeys(self.models))  # in order, once each
        for ref in self.models:
            parse_ref(ref)  # InvalidRequest (a ValueError) naming the bad reference
        if not self.model and self.models:
            self.model = self.models[0]  # older readers of `model`: the first served model
        if self.models_refresh_s <= 0:
            raise ValueError("models_refresh_s must be > 0")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes={self.max_body_bytes!r} must be an int >= 1024")
        if not 0 < self.port < 65536 and self.port != 0:
            raise ValueError(f"invalid port {self.port}")
        for name in ("max_running", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError("max_tokens_limit must be >= 1 (or unset: up to the context)")
        if self.retry_attempts < 0 or self.queue_timeout_s <= 0 or self.node_timeout_s <= 0:
            raise ValueError("retry_attempts >= 0, queue_timeout_s > 0, node_timeout_s > 0")
        if self.routing not in ("cache", "load"):
            raise ValueError(f"routing must be 'cache' or 'load', not {self.routing!r}")
        if self.cache_isolation not in ("per_key", "shared"):
            raise ValueError(f"cache_isolation must be 'per_key' or 'shared', not {self.cache_isolation!r}")
        if self.report_cached_tokens not in ("isolated", "always", "never"):
            raise ValueError("report_cached_tokens must be 'isolated', 'always' or 'never', "
                             f"not {self.report_cached_tokens!r}")
        if self.prefix_ttl_s < 0:
            raise ValueError("prefix_ttl_s must be >= 0")
        if self.pull_export_timeout_s <= 0 or self.prepull_chains < 0:
            raise ValueError("pull_export_timeout_s must be > 0 and prepull_chains >= 0")
        if self.pull_fixed_s < 0 or self.pull_bytes_per_s <= 0 or self.prefill_tokens_per_s <= 0:
            raise ValueError("need pull_fixed_s >= 0, pull_bytes_per_s > 0, prefill_tokens_per_s > 0")
        for role, _ in self.nodes:
            if role not in ("prefill", "decode", "both"):
                raise ValueError(f"invalid node role {role!r}")
        if self.admin_open and not self.admin_key and self.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"admin_open needs a loopback host, not {self.host!r}: set an admin key "
                             "($PDSERVE_ADMIN_KEY) to reach the admin API from elsewhere")
        if not self.api_keys and self.host not in ("127.0.0.1", "localhost", "::1"):
            self.host = "127.0.0.1"  # no key: never listen beyond loopback

    @property
    def open(self) -> bool:
        return not self.api_keys

    @property
    def admin_closed(self) -> bool:
        """No admin key and no explicit opt-in: every /admin/* request is refused."""
        return not self.admin_key and not self.admin_open


def keys_from_env(env: dict | None = None) -> dict:
    """PDSERVE_API_KEYS (comma-separated), PDSERVE_ADMIN_KEY, PDSERVE_INTERNAL_TOKEN, or *_FILE variants."""
    api = env_secret("PDSERVE_API_KEYS", env=env)
    return {
        "api_keys": tuple(k.strip() for k in api.split(",") if k.strip()) if api else (),
        "admin_key": env_secret("PDSERVE_ADMIN_KEY", env=env),
        "internal_token": env_secret("PDSERVE_INTERNAL_TOKEN", env=env),
    }
