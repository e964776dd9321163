-- wrk script of `make bench` (bench/bench.py): every request carries `x-user-id: u<N>`, cycling over
-- BENCH_USERS users (each wrk thread cycles on its own), and `done` prints one machine-readable line.
--
-- The same script drives every scenario, the baseline without the filter included, so the load
-- generator does the same work in each.

local users = tonumber(os.getenv("BENCH_USERS") or "64")
local counter = 0

function request()
  counter = counter + 1
  return wrk.format("GET", "/", { ["x-user-id"] = "u" .. (counter % users) })
end

-- Latencies in microseconds; summary.duration too.
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH {"requests": %d, "duration_us": %d, "connect": %d, "read": %d, "write": %d, "status": %d, ' ..
    '"timeout": %d, "p50": %d, "p90": %d, "p99": %d, "mean": %.1f, "max": %d}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean, latency.max))
end
