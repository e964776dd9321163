//! What a configuration needs on every request, prepared once per configuration and client id: each rule's
//! acquire command ([`AcquireTemplate`]), what its headers show ([`RuleHeaders`]), and the response bodies.

use alloc::rc::Rc;

use crate::prelude::*;

use crate::config::{FailureMode, PluginConfig, RateSource, WindowLayout};
use crate::response::{RuleHeaders, RulePolicy};
use crate::script::{AcquireConfig, AcquireTemplate};

/// What one rule needs on every request.
#[derive(Debug, Clone)]
pub struct RulePlan {
    /// Its acquire command.
    pub template: AcquireTemplate,
}

/// What a configuration needs on every request: its rules' plans, its headers and its response bodies.
#[derive(Debug, Clone)]
pub struct Plan {
    /// By rule index.
    pub rules: Vec<RulePlan>,
    /// What the headers of its requests show (each rule's name and `RateLimit-Policy`).
    pub headers: RuleHeaders,
    /// The body of a rejection.
    pub rejection_body: Rc<str>,
    /// The body of a failure answered locally (`failure_mode: "deny"`).
    pub failure_body: Rc<str>,
    /// `failure_mode: "deny"`: a Redis error on one limiter of a combined call leaves the others uncharged
    /// (the request will not go on).
    pub errors_stop_charge: bool,
    /// This gateway's Redisson client id (for [`Plan::sized`]).
    client_id: String,
}

impl Plan {
    /// The plan of `config` for this gateway's Redisson client id.
    pub fn new(config: &PluginConfig, client_id: &str) -> Self {
        let rules = config
            .rules
            .iter()
            .map(|rule| {
                let acquire = AcquireConfig {
                    permits: rule.permits,
                    rate: rule.rate,
                    interval_ms: rule.interval_ms,
                    limiter_type: rule.limiter_type,
                    keep_alive_ms: rule.keep_alive_ms,
                    apply_config: rule.rate_source == RateSource::Config,
                    layout: rule.layout,
                };
                RulePlan { template: AcquireTemplate::new(acquire, client_id) }
            })
            .collect();
        let headers = RuleHeaders {
            style: config.headers,
            shadow_headers: config.shadow_headers,
            // The rate rules, then the in-flight rules (no window), as the per-rule counters number them.
            rules: config
                .rules
                .iter()
                .map(|rule| RulePolicy::new(&rule.name, rule.rate, rule.interval_ms))
                .chain(config.inflight.iter().map(|rule| RulePolicy::new(&rule.name, rule.max_in_flight, 0)))
                .collect(),
        };
        Plan {
            rules,
            headers,
            rejection_body: config.rejection.body.as_str().into(),
            failure_body: "rate limiter unavailable\n".into(),
            errors_stop_charge: config.failure_mode == FailureMode::Deny,
            client_id: client_id.to_string(),
        }
    }

    /// `template` acquiring `permits` instead (a reservation sized by its request, `cost.reserve` from a
    /// header), and for a calendar quota in the period of `now_ms`: built for the call, once per send.
    pub fn sized(&self, template: &AcquireTemplate, permits: u64, now_ms: u64) -> AcquireTemplate {
        let config = AcquireConfig { permits, ..*template.config() };
        match config.layout {
            WindowLayout::Calendar { period, zone } => {
                let (start_ms, end_ms) = zone.period(period, now_ms);
                AcquireTemplate::in_period(config, &self.client_id, start_ms, end_ms)
            }
            _ => AcquireTemplate::new(config, &self.client_id),
        }
    }

    /// Rule `rule`'s name, if the configuration has such a rule.
    pub fn rule_name(&self, rule: usize) -> Option<&Rc<str>> {
        self.headers.rules.get(rule).map(|r| &r.name)
    }
}
