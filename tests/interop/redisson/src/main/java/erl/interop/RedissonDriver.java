package erl.interop;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ArrayNode;
import com.fasterxml.jackson.databind.node.ObjectNode;
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;
import org.redisson.Redisson;
import org.redisson.api.RPermitExpirableSemaphore;
import org.redisson.api.RRateLimiter;
import org.redisson.api.RateLimiterConfig;
import org.redisson.api.RateType;
import org.redisson.api.RedissonClient;
import org.redisson.api.ratelimiter.RateLimiterArgs;
import org.redisson.config.Config;

/**
 * One Redisson instance (its own client id, as PER_CLIENT limiters need) driven by JSON lines: a request
 * per line on stdin, its answer as one line on stdout, in order.
 *
 * <p>Usage: {@code java -cp ... erl.interop.RedissonDriver redis://127.0.0.1:PORT}. It prints
 * {@code {"ready":true,"id":"<client id>","version":"<Redisson version>"}} once connected, then answers each
 * request {@code {"id":N,"op":"...",...}} with {@code {"id":N,"result":...,"start_ms":S,"end_ms":E}}, where S
 * and E are this machine's wall clock in epoch ms read just before and after the Redisson call (Redisson
 * stamps an acquire with {@code System.currentTimeMillis()} in between), or with
 * {@code {"id":N,"error":"message","exception":"class name"}} when Redisson threw. It exits at the end of
 * stdin. Durations are whole milliseconds; {@code type} is {@code OVERALL} or {@code PER_CLIENT}.
 *
 * <p>Operations (each a method of Redisson's {@code RRateLimiter} on {@code getRateLimiter(name)}):
 * trySetRate, setRate (the reset form), setRateArgs ({@code setRate(RateLimiterArgs)} with keep_state),
 * updateRate, tryAcquire, availablePermits, getConfig, delete, expire, clearExpire, remainTimeToLive,
 * release; and hammer: {@code threads} threads calling tryAcquire (with {@code timeout_ms}, waiting up to it)
 * for {@code ms}, {@code pause_ms} apart,
 * each call's start, end and outcome returned.
 *
 * <p>Operations whose name starts with {@code sem} are methods of Redisson's {@code RPermitExpirableSemaphore}
 * on {@code getPermitExpirableSemaphore(name)}: semTrySetPermits, semTryAcquire (with {@code lease_ms}: the
 * permit's id as 32 hex digits, or null), semRelease ({@code tryRelease(id)}), semAvailablePermits,
 * semAcquiredPermits, semPermits ({@code getPermits}), semLeaseTime ({@code getLeaseTime(id)}); and semHammer:
 * {@code threads} threads taking a permit with {@code lease_ms}, holding it {@code hold_ms}, releasing it, for
 * {@code ms}: each permit's start (taken) and end (just before its release) returned, in epoch microseconds.
 */
public final class RedissonDriver {
    private static final ObjectMapper JSON = new ObjectMapper();

    private final RedissonClient redisson;

    private RedissonDriver(RedissonClient redisson) {
        this.redisson = redisson;
    }

    public static void main(String[] args) throws Exception {
        if (args.length != 1) {
            System.err.println("usage: RedissonDriver redis://127.0.0.1:PORT");
            System.exit(2);
        }
        Config config = new Config();
        // Few connections and threads: a test process on a 2-core machine, not a service; defaults would open
        // 24 connections at start.
        config.setThreads(2).setNettyThreads(4);
        config.useSingleServer()
                .setAddress(args[0])
                .setConnectionMinimumIdleSize(2)
                .setConnectionPoolSize(16)
                .setSubscriptionConnectionMinimumIdleSize(0)
                .setSubscriptionConnectionPoolSize(1)
                .setTimeout(10_000)
                .setRetryAttempts(0);
        RedissonClient redisson = Redisson.create(config);
        PrintStream out = new PrintStream(System.out, true, StandardCharsets.UTF_8);
        try {
            ObjectNode ready = JSON.createObjectNode();
            ready.put("ready", true);
            ready.put("id", redisson.getId());
            ready.put("version", Redisson.class.getPackage().getImplementationVersion());
            out.println(JSON.writeValueAsString(ready));
            new RedissonDriver(redisson).serve(
                    new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8)), out);
        } finally {
            redisson.shutdown(0, 2, java.util.concurrent.TimeUnit.SECONDS);
        }
    }

    private void serve(BufferedReader in, PrintStream out) throws Exception {
        String line;
        while ((line = in.readLine()) != null) {
            if (line.isBlank()) {
                continue;
            }
            JsonNode request = JSON.readTree(line);
            ObjectNode answer = JSON.createObjectNode();
            answer.set("id", request.get("id"));
            long start = System.currentTimeMillis();
            try {
                Object result = call(request);
                long end = System.currentTimeMillis();
                answer.set("result", JSON.valueToTree(result));
                answer.put("start_ms", start);
                answer.put("end_ms", end);
            } catch (RuntimeException error) {
                answer.put("error", String.valueOf(error.getMessage()));
                answer.put("exception", error.getClass().getName());
            }
            out.println(JSON.writeValueAsString(answer));
        }
    }

    private Object call(JsonNode request) throws Exception {
        String op = request.path("op").asText();
        if (op.startsWith("sem")) {
            return semaphore(op, redisson.getPermitExpirableSemaphore(request.path("name").asText()), request);
        }
        RRateLimiter limiter = redisson.getRateLimiter(request.path("name").asText());
        switch (op) {
            case "trySetRate":
                return limiter.trySetRate(type(request), request.path("rate").asLong(), millis(request, "interval_ms"),
                        millis(request, "keep_alive_ms"));
            case "setRate":
                limiter.setRate(type(request), request.path("rate").asLong(), millis(request, "interval_ms"),
                        millis(request, "keep_alive_ms"));
                return null;
            case "setRateArgs":
                limiter.setRate(args(request));
                return null;
            case "updateRate":
                return limiter.updateRate(args(request));
            case "tryAcquire":
                return limiter.tryAcquire(request.path("permits").asLong(1));
            case "availablePermits":
                return limiter.availablePermits();
            case "getConfig":
                RateLimiterConfig config = limiter.getConfig();
                ObjectNode node = JSON.createObjectNode();
                node.put("type", config.getRateType().name());
                node.put("rate", config.getRate());
                node.put("interval_ms", config.getRateInterval());
                return node;
            case "delete":
                return limiter.delete();
            case "expire":
                return limiter.expire(millis(request, "ttl_ms"));
            case "clearExpire":
                return limiter.clearExpire();
            case "remainTimeToLive":
                return limiter.remainTimeToLive();
            case "release":
                limiter.release(request.path("permits").asLong(1));
                return null;
            case "hammer":
                return hammer(limiter, request.path("threads").asInt(1), request.path("ms").asLong(),
                        request.path("pause_ms").asLong(0), request.path("permits").asLong(1),
                        request.path("timeout_ms").asLong(0));
            default:
                throw new IllegalArgumentException("unknown op " + op);
        }
    }

    private static Object semaphore(String op, RPermitExpirableSemaphore semaphore, JsonNode request)
            throws Exception {
        switch (op) {
            case "semTrySetPermits":
                return semaphore.trySetPermits(request.path("permits").asInt());
            case "semTryAcquire":
                return semaphore.tryAcquire(0, request.path("lease_ms").asLong(), TimeUnit.MILLISECONDS);
            case "semRelease":
                return semaphore.tryRelease(request.path("permit").asText());
            case "semAvailablePermits":
                return semaphore.availablePermits();
            case "semAcquiredPermits":
                return semaphore.acquiredPermits();
            case "semPermits":
                return semaphore.getPermits();
            case "semLeaseTime":
                return semaphore.getLeaseTime(request.path("permit").asText());
            case "semHammer":
                return semHammer(semaphore, request.path("threads").asInt(1), request.path("ms").asLong(),
                        request.path("hold_ms").asLong(), request.path("lease_ms").asLong());
            default:
                throw new IllegalArgumentException("unknown op " + op);
        }
    }

    /**
     * [taken us, released us] of every permit taken by every thread: epoch microseconds read after the take and
     * before the release (microseconds, not {@code currentTimeMillis}: a whole ms read after a take can be
     * before it, and a test comparing these spans with the gateway's would see overlaps that never were).
     */
    private static ArrayNode semHammer(RPermitExpirableSemaphore semaphore, int threads, long ms, long holdMs,
            long leaseMs) throws Exception {
        ExecutorService pool = Executors.newFixedThreadPool(threads);
        long stop = System.currentTimeMillis() + ms;
        List<Future<List<long[]>>> runs = new ArrayList<>();
        for (int i = 0; i < threads; i++) {
            runs.add(pool.submit(() -> {
                List<long[]> held = new ArrayList<>();
                while (System.currentTimeMillis() < stop) {
                    String permit = semaphore.tryAcquire(0, leaseMs, TimeUnit.MILLISECONDS);
                    long taken = epochMicros();
                    if (permit == null) {
                        Thread.sleep(1);
                        continue;
                    }
                    Thread.sleep(holdMs);
                    long released = epochMicros();
                    semaphore.tryRelease(permit);
                    held.add(new long[] {taken, released});
                }
                return held;
            }));
        }
        ArrayNode all = JSON.createArrayNode();
        for (Future<List<long[]>> run : runs) {
            for (long[] permit : run.get()) {
                all.add(JSON.createArrayNode().add(permit[0]).add(permit[1]));
            }
        }
        pool.shutdown();
        return all;
    }

    /** The wall clock in epoch microseconds ({@code Instant.now()}: microseconds on Linux from JDK 15). */
    private static long epochMicros() {
        Instant now = Instant.now();
        return now.getEpochSecond() * 1_000_000L + now.getNano() / 1_000;
    }

    private static RateType type(JsonNode request) {
        return RateType.valueOf(request.path("type").asText("OVERALL"));
    }

    private static Duration millis(JsonNode request, String field) {
        return Duration.ofMillis(request.path(field).asLong(0));
    }

    /** {@code RateLimiterArgs.of(type, rate, interval).keepAliveTime(..).keepState(..)} (Redisson 4.4+). */
    private static RateLimiterArgs args(JsonNode request) {
        return RateLimiterArgs.of(type(request), request.path("rate").asLong(), millis(request, "interval_ms"))
                .keepAliveTime(millis(request, "keep_alive_ms"))
                .keepState(request.path("keep_state").asBoolean(false));
    }

    /**
     * [start ms, end ms, 1 acquired / 0 refused / -1 threw] of every tryAcquire of every thread: {@code
     * tryAcquire(permits)}, or with {@code timeoutMs} > 0 {@code tryAcquire(permits, timeoutMs, MILLISECONDS)}
     * (Redisson waits for the permits up to the timeout).
     */
    private static ArrayNode hammer(RRateLimiter limiter, int threads, long ms, long pauseMs, long permits,
            long timeoutMs) throws Exception {
        ExecutorService pool = Executors.newFixedThreadPool(threads);
        long stop = System.currentTimeMillis() + ms;
        List<Future<List<long[]>>> runs = new ArrayList<>();
        for (int i = 0; i < threads; i++) {
            runs.add(pool.submit(() -> {
                List<long[]> calls = new ArrayList<>();
                while (System.currentTimeMillis() < stop) {
                    long start = System.currentTimeMillis();
                    long outcome;
                    try {
                        boolean acquired = timeoutMs > 0
                                ? limiter.tryAcquire(permits, timeoutMs, TimeUnit.MILLISECONDS)
                                : limiter.tryAcquire(permits);
                        outcome = acquired ? 1 : 0;
                    } catch (RuntimeException error) {
                        outcome = -1;
                    }
                    calls.add(new long[] {start, System.currentTimeMillis(), outcome});
                    if (pauseMs > 0) {
                        Thread.sleep(pauseMs);
                    }
                }
                return calls;
            }));
        }
        ArrayNode all = JSON.createArrayNode();
        for (Future<List<long[]>> run : runs) {
            for (long[] call : run.get()) {
                all.add(JSON.createArrayNode().add(call[0]).add(call[1]).add(call[2]));
            }
        }
        pool.shutdown();
        return all;
    }
}
