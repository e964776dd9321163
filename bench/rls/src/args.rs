//! The command line: `--port`, `--redis`, `--limits`, `--storage`, `--threads`.

use std::path::PathBuf;

/// What `--help` and a bad command line print.
pub const USAGE: &str = "usage: erl-peer-rls --port PORT --redis redis://HOST:PORT --limits FILE.json \
                         [--storage redis|redis_cached] [--threads N]";

/// Which limitador storage keeps the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// `AsyncRedisStorage`: every check reads the counters from Redis and every admitted request updates
    /// them there (two round trips per admitted request).
    Redis,
    /// `CachedRedisStorage` with limitador's defaults (flushed every 1 s in batches of 100, 10,000 counters
    /// cached, 350 ms Redis timeout): decided from the local cache, Redis updated in the background.
    RedisCached,
}

impl Storage {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Storage::Redis => "redis",
            Storage::RedisCached => "redis_cached",
        }
    }
}

/// The parsed command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Args {
    /// The gRPC port on 127.0.0.1.
    pub port: u16,
    /// The Redis URL (`redis://127.0.0.1:6379`), as limitador's storages take it.
    pub redis_url: String,
    /// The limits file (`limits::load`).
    pub limits: PathBuf,
    /// The counters' storage; `redis` unless given.
    pub storage: Storage,
    /// Tokio worker threads; the CPUs this process may use unless given.
    pub threads: usize,
}

impl Args {
    /// Parses the arguments after the program name. Errors name the option.
    pub fn parse(arguments: impl IntoIterator<Item = String>) -> Result<Args, String> {
        let mut port = None;
        let mut redis_url = None;
        let mut limits = None;
        let mut storage = Storage::Redis;
        let mut threads = std::thread::available_parallelism().map_or(2, usize::from);
        let mut arguments = arguments.into_iter();
        while let Some(option) = arguments.next() {
            if option == "--help" || option == "-h" {
                return Err("help".to_owned());
            }
            let value = arguments.next().ok_or_else(|| format!("{option}: a value is missing"))?;
            match option.as_str() {
                "--port" => port = Some(value.parse::<u16>().map_err(|error| format!("--port {value:?}: {error}"))?),
                "--redis" => redis_url = Some(value),
                "--limits" => limits = Some(PathBuf::from(value)),
                "--storage" => {
                    storage = match value.as_str() {
                        "redis" => Storage::Redis,
                        "redis_cached" => Storage::RedisCached,
                        _ => return Err(format!("--storage {value:?}: redis or redis_cached")),
                    }
                }
                "--threads" => {
                    threads = value
                        .parse::<usize>()
                        .ok()
                        .filter(|threads| (1..=64).contains(threads))
                        .ok_or_else(|| format!("--threads {value:?}: a whole number from 1 to 64"))?;
                }
                _ => return Err(format!("unknown option {option:?}")),
            }
        }
        Ok(Args {
            port: port.ok_or("--port is missing")?,
            redis_url: redis_url.ok_or("--redis is missing")?,
            limits: limits.ok_or("--limits is missing")?,
            storage,
            threads,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: &str) -> Result<Args, String> {
        Args::parse(line.split_whitespace().map(str::to_owned))
    }

    #[test]
    fn parses_every_option() {
        let args = parse("--port 18081 --redis redis://127.0.0.1:7 --limits l.json --storage redis_cached --threads 1");
        assert_eq!(
            args,
            Ok(Args {
                port: 18081,
                redis_url: "redis://127.0.0.1:7".to_owned(),
                limits: PathBuf::from("l.json"),
                storage: Storage::RedisCached,
                threads: 1,
            })
        );
    }

    #[test]
    fn storage_defaults_to_redis() {
        assert_eq!(parse("--port 1 --redis r --limits l").map(|a| a.storage), Ok(Storage::Redis));
    }

    #[test]
    fn refusals_name_the_option() {
        assert_eq!(parse("--redis r --limits l"), Err("--port is missing".to_owned()));
        assert!(parse("--port 70000 --redis r --limits l").is_err_and(|e| e.starts_with("--port")));
        assert!(parse("--port 1 --redis r --limits l --storage disk").is_err_and(|e| e.starts_with("--storage")));
        assert!(parse("--port 1 --redis r --limits l --threads 0").is_err_and(|e| e.starts_with("--threads")));
        assert!(parse("--port 1 --redis").is_err_and(|e| e.starts_with("--redis")));
        assert!(parse("--port 1 --bogus x").is_err_and(|e| e.contains("--bogus")));
    }
}
