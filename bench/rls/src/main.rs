//! erl-peer-rls: the peer of `make bench` section 9, a minimal Envoy rate limit service.
//!
//! Envoy's native global rate limit filter (`envoy.filters.http.ratelimit`) asks a rate limit service over
//! gRPC (`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`) whether a request is over a limit.
//! This binary is such a service built on Kuadrant's `limitador` crate, the engine of Limitador: limitador
//! keeps the limits, resolves the counters and checks and updates them in Redis (its `AsyncRedisStorage`,
//! or its `CachedRedisStorage` that counts locally and flushes to Redis in batches). The code here is only
//! the gRPC glue, the command line and the limits file.
//!
//! ```text
//! erl-peer-rls --port 18081 --redis redis://127.0.0.1:6379 --limits limits.json [--storage redis|redis_cached]
//!              [--threads N]
//! ```
//!
//! Layout:
//! - `args`: the command line.
//! - `limits`: the limits file (limitador's limit fields, as JSON).
//! - `service`: `ShouldRateLimit`: domain -> limitador namespace, descriptors -> the `descriptors` list of
//!   the limits' expressions (as Limitador's own server), check and update, the answer.
//!
//! It listens on 127.0.0.1 only and exits with code 0 on SIGTERM or SIGINT; a bad command line, limits file
//! or Redis URL exits with code 2 and one line on stderr.

mod args;
mod limits;
mod service;

use std::net::{Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use limitador::storage::redis::{AsyncRedisStorage, CachedRedisStorage};
use limitador::storage::AsyncCounterStorage;
use limitador::AsyncRateLimiter;
use tokio::signal::unix::{signal, SignalKind};

use crate::args::{Args, Storage};
use crate::service::Rls;

fn main() -> ExitCode {
    let args = match Args::parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(error) => {
            eprintln!("erl-peer-rls: {error}\n{}", args::USAGE);
            return ExitCode::from(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(args.threads).enable_all().build();
    let runtime = match runtime {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("erl-peer-rls: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(RunError::Setup(message)) => {
            eprintln!("erl-peer-rls: {message}");
            ExitCode::from(2)
        }
        Err(RunError::Serve(message)) => {
            eprintln!("erl-peer-rls: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Why the service stopped other than by a signal.
enum RunError {
    /// Before serving: the limits file, the Redis URL or Redis itself, the signal handlers.
    Setup(String),
    /// While serving: the listener.
    Serve(String),
}

/// Loads the limits, connects the storage, serves until SIGTERM or SIGINT.
async fn run(args: Args) -> Result<(), RunError> {
    let limits = limits::load(&args.limits).map_err(RunError::Setup)?;
    let storage: Box<dyn AsyncCounterStorage> = match args.storage {
        Storage::Redis => Box::new(
            AsyncRedisStorage::new(&args.redis_url)
                .await
                .map_err(|error| RunError::Setup(format!("redis storage {}: {error}", args.redis_url)))?,
        ),
        Storage::RedisCached => Box::new(
            CachedRedisStorage::new(&args.redis_url)
                .await
                .map_err(|error| RunError::Setup(format!("redis_cached storage {}: {error}", args.redis_url)))?,
        ),
    };
    let limiter = AsyncRateLimiter::new_with_storage(storage);
    let count = limits.len();
    for limit in limits {
        limiter.add_limit(limit);
    }

    let mut terminate =
        signal(SignalKind::terminate()).map_err(|error| RunError::Setup(format!("SIGTERM: {error}")))?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(|error| RunError::Setup(format!("SIGINT: {error}")))?;
    let shutdown = async move {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
    };

    let address = SocketAddr::from((Ipv4Addr::LOCALHOST, args.port));
    eprintln!(
        "erl-peer-rls: listening on {address}, {count} limits, storage {}, {} threads",
        args.storage.name(),
        args.threads
    );
    tonic::transport::Server::builder()
        .add_service(RateLimitServiceServer::new(Rls::new(Arc::new(limiter))))
        .serve_with_shutdown(address, shutdown)
        .await
        .map_err(|error| RunError::Serve(format!("serving on {address}: {error}")))
}
