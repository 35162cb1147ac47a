"""Prometheus metrics of one app (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tunecache.store import JOB_STATUSES, Store


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.lookups = Counter("tunecache_lookups", "Config lookups", registry=r)
        self.hits = Counter("tunecache_lookup_hits", "Lookups that found a tuned config", registry=r)
        self.misses = Counter("tunecache_lookup_misses", "Lookups that found no tuned config", registry=r)
        self.publishes = Counter("tunecache_publishes", "Published results by outcome", ["outcome"], registry=r)
        self.enqueued = Counter("tunecache_jobs_enqueued", "Enqueue requests", registry=r)
        self.job_events = Counter("tunecache_job_events", "Worker job transitions", ["event"], registry=r)
        self.queue_depth = Gauge("tunecache_queue_depth", "Tuning jobs per status", ["status"], registry=r)
        self.tune_seconds = Histogram(
            "tunecache_tune_seconds",
            "Seconds a worker spent tuning one job",
            buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1200, 3600),
            registry=r,
        )
        self.lookup_reads = Counter(
            "tunecache_lookup_store_reads",
            "Lookups this process answered from the store (not from its lookup cache)",
            registry=r,
        )
        self.publish_seconds = Counter(
            "tunecache_publish_seconds", "Seconds this process spent taking publishes", registry=r
        )
        self.publish_held_seconds = Counter(
            "tunecache_publish_held_seconds",
            "Seconds publishes waited so that lookups kept the rest (TUNECACHE_PUBLISH_SHARE)",
            registry=r,
        )
        self.token_checks = Counter(
            "tunecache_token_checks", "Tokens looked up in the database (the token cache did not know them)", registry=r
        )

    def lookup(self, hit: bool) -> None:
        self.lookups.inc()
        (self.hits if hit else self.misses).inc()

    def refresh(self, store: Store) -> None:
        """Set the gauges read from the store (at each scrape)."""
        for status, n in store.job_counts().items():
            if status in JOB_STATUSES:
                self.queue_depth.labels(status).set(n)

    def render(self, store: Store) -> bytes:
        self.refresh(store)
        return generate_latest(self.registry)

    def serve(self, store: Store, host: str, port: int):
        """Serve these metrics on their own address (prometheus_client's server, a thread of
        this process): `tunecache serve --metrics-port`. Returns the server, to shut down."""
        from prometheus_client import start_http_server

        metrics = self

        class _Scrape:  # the gauges refreshed at each scrape, as on /metrics
            def collect(self):
                metrics.refresh(store)
                return metrics.registry.collect()

        scrape = CollectorRegistry(auto_describe=False)
        scrape.register(_Scrape())
        server, _thread = start_http_server(port, addr=host, registry=scrape)
        return server
