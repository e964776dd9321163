//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` on limitador.
//!
//! The request's `domain` is the limitador namespace; its descriptors, in order, become the list
//! `descriptors` the limits' expressions read (`descriptors[0]['x-user-id']`), each descriptor a map of its
//! entries' keys to values, as in Limitador's own server; `hits_addend` (0 meaning 1) is the delta.
//! limitador checks every counter that applies and, if none is over its limit, adds the delta to each
//! (`AsyncRateLimiter::check_rate_limited_and_update`). The answer is OK or OVER_LIMIT; a request without a
//! domain or a descriptor is INVALID_ARGUMENT, a storage failure UNAVAILABLE (Envoy then applies its
//! `failure_mode_deny`).

use std::collections::HashMap;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use limitador::limit::{Context, Namespace};
use limitador::AsyncRateLimiter;
use tonic::{Request, Response, Status};

/// The rate limit service: one limitador limiter shared by every request.
pub struct Rls {
    limiter: Arc<AsyncRateLimiter>,
}

impl Rls {
    /// A service deciding with `limiter` (its limits already added).
    pub fn new(limiter: Arc<AsyncRateLimiter>) -> Self {
        Rls { limiter }
    }
}

/// What limitador is asked for one request.
#[derive(Debug, PartialEq, Eq)]
pub struct Query {
    /// The namespace: the request's domain.
    pub namespace: String,
    /// One map per descriptor, in order: entry key -> value (a later entry wins over an earlier one).
    pub descriptors: Vec<HashMap<String, String>>,
    /// The hits the request adds: `hits_addend`, or 1 when it is 0 (proto3's unset).
    pub delta: u64,
}

impl Query {
    /// The query of a `ShouldRateLimit` request; INVALID_ARGUMENT without a domain or a descriptor.
    pub fn from_request(request: RateLimitRequest) -> Result<Query, Status> {
        if request.domain.is_empty() {
            return Err(Status::invalid_argument("domain is empty"));
        }
        if request.descriptors.is_empty() {
            return Err(Status::invalid_argument("no descriptor"));
        }
        Ok(Query {
            namespace: request.domain,
            descriptors: request.descriptors.into_iter().map(descriptor_map).collect(),
            delta: u64::from(request.hits_addend.max(1)),
        })
    }

    /// The limitador context: the list `descriptors`.
    fn context(&self) -> Context<'static> {
        let mut context = Context::default();
        context.list_binding("descriptors".to_owned(), self.descriptors.clone());
        context
    }
}

fn descriptor_map(descriptor: RateLimitDescriptor) -> HashMap<String, String> {
    descriptor.entries.into_iter().map(|entry| (entry.key, entry.value)).collect()
}

#[tonic::async_trait]
impl RateLimitService for Rls {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let query = Query::from_request(request.into_inner())?;
        let namespace = Namespace::from(query.namespace.as_str());
        let context = query.context();
        let result = self
            .limiter
            .check_rate_limited_and_update(&namespace, &context, query.delta)
            .await
            .map_err(|error| Status::unavailable(format!("limitador: {error}")))?;
        let code = if result.limited { Code::OverLimit } else { Code::Ok };
        Ok(Response::new(RateLimitResponse { overall_code: code.into(), ..RateLimitResponse::default() }))
    }
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;

    use super::*;

    fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
        RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(key, value)| Entry { key: (*key).to_owned(), value: (*value).to_owned() })
                .collect(),
            ..RateLimitDescriptor::default()
        }
    }

    fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>, hits_addend: u32) -> RateLimitRequest {
        RateLimitRequest { domain: domain.to_owned(), descriptors, hits_addend }
    }

    #[test]
    fn domain_and_descriptors_become_the_query() {
        let query = Query::from_request(request(
            "peer-allowed",
            vec![descriptor(&[("x-user-id", "u7")]), descriptor(&[("generic_key", "global"), ("a", "1")])],
            0,
        ));
        let expected = Query {
            namespace: "peer-allowed".to_owned(),
            descriptors: vec![
                HashMap::from([("x-user-id".to_owned(), "u7".to_owned())]),
                HashMap::from([("generic_key".to_owned(), "global".to_owned()), ("a".to_owned(), "1".to_owned())]),
            ],
            delta: 1,
        };
        assert_eq!(query.ok(), Some(expected));
    }

    #[test]
    fn hits_addend_is_the_delta() {
        let query = Query::from_request(request("d", vec![descriptor(&[("k", "v")])], 5));
        assert_eq!(query.ok().map(|q| q.delta), Some(5));
    }

    #[test]
    fn a_request_without_domain_or_descriptor_is_invalid() {
        let code = |r| Query::from_request(r).err().map(|status| status.code());
        assert_eq!(code(request("", vec![descriptor(&[("k", "v")])], 1)), Some(tonic::Code::InvalidArgument));
        assert_eq!(code(request("d", vec![], 1)), Some(tonic::Code::InvalidArgument));
    }
}
