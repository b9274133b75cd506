"""The metrics endpoint: rank 0 serves its latest step's metrics in the Prometheus text format (version 0.0.4)
on ``http://logging.metrics_host:logging.metrics_port/metrics`` while it trains (``logging.metrics_port = 0``:
off). A daemon thread with the standard library's HTTP server; the training loop only swaps in a new
snapshot after each step, so a slow scraper never holds a step up."""

from __future__ import annotations

import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: (name, type, help, key in the trainer's per-step metrics dict, scale)
GAUGES = [
    ("megacore_step", "gauge", "Optimizer steps completed.", "step", 1),
    ("megacore_loss", "gauge", "Training loss of the latest step.", "loss", 1),
    ("megacore_grad_norm", "gauge", "Global gradient norm of the latest step (before clipping).", "grad_norm", 1),
    ("megacore_learning_rate", "gauge", "Learning rate of the latest step.", "lr", 1),
    ("megacore_tokens_per_second", "gauge", "Training throughput of the latest step, whole job.", "tokens_per_s", 1),
    ("megacore_tflops_per_gpu", "gauge", "Model TFLOP/s per rank of the latest step.", "tflops_per_gpu", 1),
    ("megacore_mfu_ratio", "gauge", "Model FLOPs utilisation (0..1) against trainer.peak_tflops.", "mfu", 1),
    ("megacore_memory_allocated_bytes", "gauge", "Device memory allocated by rank 0.", "mem_allocated_gib", 2**30),
    ("megacore_memory_peak_bytes", "gauge", "Peak device memory allocated by rank 0.", "mem_peak_gib", 2**30),
    ("megacore_step_seconds", "gauge", "Wall time of the latest step.", "step_seconds", 1),
    ("megacore_consumed_samples", "gauge", "Training samples consumed so far.", "consumed_samples", 1),
]


def _value(v) -> str:
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def render(metrics: dict | None, restarts: int = 0, skipped_steps: int = 0, nonfinite_steps: int = 0,
           loss_spikes: int = 0, straggler_steps: int = 0) -> str:
    """The exposition text of one snapshot (metrics: the trainer's per-step dict, None before the first step)."""
    out = []
    for name, kind, doc, key, scale in GAUGES:
        if metrics is None or key not in metrics:
            continue
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name} {_value(metrics[key] * scale)}"]
    per_rank = (metrics or {}).get("rank_compute_seconds") or []
    if per_rank:
        out += ["# HELP megacore_rank_compute_seconds Each rank's compute time in the latest step (up to the "
                "data-parallel gradient reduction); trainer.straggler_factor > 0.",
                "# TYPE megacore_rank_compute_seconds gauge"]
        out += [f'megacore_rank_compute_seconds{{rank="{r}"}} {_value(t)}' for r, t in enumerate(per_rank)]
        out += ["# HELP megacore_straggler_steps_total Steps in which some rank was slower than "
                "trainer.straggler_factor times the median.",
                "# TYPE megacore_straggler_steps_total counter", f"megacore_straggler_steps_total {straggler_steps}"]
    out += ["# HELP megacore_restarts_total Times megacore.launch restarted the job's ranks after a failure.",
            "# TYPE megacore_restarts_total counter", f"megacore_restarts_total {restarts}",
            "# HELP megacore_skipped_steps_total Steps skipped for non-finite gradients in this run.",
            "# TYPE megacore_skipped_steps_total counter", f"megacore_skipped_steps_total {skipped_steps}",
            "# HELP megacore_nonfinite_steps_total Steps whose loss or gradient norm was NaN or Inf in this run.",
            "# TYPE megacore_nonfinite_steps_total counter", f"megacore_nonfinite_steps_total {nonfinite_steps}",
            "# HELP megacore_loss_spikes_total Steps whose loss exceeded trainer.loss_spike_factor x its moving "
            "average in this run.",
            "# TYPE megacore_loss_spikes_total counter", f"megacore_loss_spikes_total {loss_spikes}"]
    return "\n".join(out) + "\n"


class MetricsServer:
    """Serves the latest snapshot at /metrics on (host, port) from a daemon thread until close()."""

    def __init__(self, host: str, port: int, restarts: int = 0):
        self._lock = threading.Lock()
        self._metrics = None
        self._restarts = restarts
        self._skipped = self._nonfinite = self._spikes = self._stragglers = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "the metrics are at /metrics")
                    return
                body = server.text().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # one line per scrape would drown the training log
                pass

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.address = self._httpd.server_address[:2]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="megacore-metrics", daemon=True)
        self._thread.start()

    def update(self, metrics: dict) -> None:
        with self._lock:
            self._metrics = dict(metrics)
            self._skipped += bool(metrics.get("skipped"))
            self._nonfinite += bool(metrics.get("nonfinite"))
            self._spikes += bool(metrics.get("loss_spike"))
            self._stragglers += bool(metrics.get("stragglers"))

    def text(self) -> str:
        with self._lock:
            return render(self._metrics, self._restarts, self._skipped, self._nonfinite, self._spikes,
                          self._stragglers)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
