"""`tandem bench soak`: minutes to hours of mixed traffic against one engine, through every door at once,
sampled every few seconds and checked at the end (benchmarks/soak/run.py); `tandem bench abuse`: the memory
bounds under abuse at full size (benchmarks/soak/abuse.py)."""

# The soak's defaults for engine options (the user's flags win): a host KV tier, and a device pool small
# enough that the mixed traffic retracts requests and reloads prefixes from the host; a grammar timeout short
# enough for the slow grammars to pass it cheaply; a request limit low enough to send bodies over it often.
# Speculation is engine-wide, not per request: pass --speculative-method ngram to soak it.
ENGINE_DEFAULTS = {"kv_cache_tokens": 2048, "host_kv_tokens": 16384, "grammar_compile_timeout_s": 0.5,
                   "max_request_bytes": 4 * 2**20}
