"""The server's limits and timings, one place for each (tests patch them here)."""

MAX_BODY_BYTES = 16 << 20  # a request body larger than this is refused (413)
MAX_HEAD_BYTES = 16 << 10  # a request line and headers larger than this are refused (431; h11's own default)
MAX_CONNECTIONS = 512  # open connections; one more is answered 503 and closed (below the usual 1024 fds)
HEAD_SECONDS = 20  # a request line and headers must arrive whole within this (408; Apache's mod_reqtimeout: 20)
BODY_SECONDS = 30  # a body must arrive within this ...
BODY_BYTES_PER_SECOND = 64 << 10  # ... plus a second per this many bytes of it (408)
IDLE_SECONDS = 5  # a kept-alive connection with no request for this long is closed (uvicorn's default)
STALLED_WRITE_SECONDS = 60  # a client that reads nothing of its response for this long is gone
GRACEFUL_SHUTDOWN_SECONDS = 30  # SIGTERM: the running requests' time to finish before they are cancelled
RETRY_AFTER_SECONDS = 1  # a 503's Retry-After
KEEPALIVE_SECONDS = 10  # a stream with no event for this long gets an SSE comment line
PREPARE_SECONDS = 30  # rendering the template and tokenizing a request: its bound
# requests prepared at once, in their order of arrival (a semaphore's FIFO): each one more competes
# with the event loop for the GIL (four 15 MB prompts stalled /health 0.7-1.5 s with 4, 0.1-0.5 s
# with 1); a model's template that loops holds it up to PREPARE_SECONDS
PREP_WORKERS = 1
WARM_UP_TOKENS = 16  # the warm-up's prompt: one prefill chunk, then a decoded token
SEED_HEADER = "X-Colibri-Seed"  # the seed a request ran with (its own, or the fresh one drawn for it)
