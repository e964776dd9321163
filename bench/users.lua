-- wrk script of `make bench` (bench/bench.py): every request carries `x-user-id: u<N>`, cycling over
-- BENCH_USERS users (each wrk thread cycles on its own), and `done` prints one machine-readable line.
-- With BENCH_ATTACKERS > 0, BENCH_ATTACK_PERCENT of the requests carry `x-user-id: attacker<N>` instead,
-- cycling over that many attacking keys (spread evenly: of every 100 requests, the first PERCENT).
--
-- The same script drives every scenario, the baseline without the filter included, so the load
-- generator does the same work in each.

local users = tonumber(os.getenv("BENCH_USERS") or "64")
local attackers = tonumber(os.getenv("BENCH_ATTACKERS") or "0")
local attack_percent = tonumber(os.getenv("BENCH_ATTACK_PERCENT") or "0")
local counter = 0

function request()
  counter = counter + 1
  local user
  if attackers > 0 and counter % 100 < attack_percent then
    user = "attacker" .. (counter % attackers)
  else
    user = "u" .. (counter % users)
  end
  return wrk.format("GET", "/", { ["x-user-id"] = user })
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
