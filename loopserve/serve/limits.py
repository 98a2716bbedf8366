"""The server's limits unless flags say otherwise: the `serve` flags' defaults (serve/cli.py), `ServerSettings`'
(serve/api.py) and the connection's (serve/connection.py). No third-party imports: `loopserve --help` reads them."""

MAX_QUEUED_REQUESTS = 256  # sequences (samples) accepted beyond max_num_seqs
MAX_REQUEST_BODY_BYTES = 4 * 2**20
REQUEST_READ_TIMEOUT_S = 30.0
# a request body may take BODY_TIMEOUTS read timeouts, plus its bytes at MIN_BODY_RATE bytes/s (a 4 MiB body: 256 s
# more), before it counts as too slow (408)
BODY_TIMEOUTS = 4
MIN_BODY_RATE = 16 * 1024
LOG_STATS_INTERVAL_S = 10.0
CORS_ANY = ("*",)  # CORS: every method, every header (once origins are allowed)
# the prefix of the metrics' names (`serve --metric-prefix`, the first the default): loopserve's own, or vLLM's, whose
# Grafana dashboards and alerts then read them as they are
METRIC_PREFIXES = {"loopserve": "loopserve:", "vllm": "vllm:"}
