//! The bytes of a waiting request's Redis calls ([`PendingRequest::encode`]): its rule calls in one ACQUIRE,
//! or together in one ACQUIRE_ALL, each with its rule's template or one built for the call (a reservation
//! sized by its request, a calendar quota's period).

use smallvec::SmallVec;

use crate::prelude::*;

use crate::script::{encode_acquire_all_laid_out, AcquirePart, AcquireTemplate, Clock, Encoding, Invocation, Layout};

use super::pending::{PendingRequest, RuleCall};
use super::Plan;

impl PendingRequest {
    /// The bytes of send `send`, by sha or by source, in the transport's wire form; `None` for an unknown
    /// send.
    pub fn encode(&self, send: usize, invocation: Invocation, encoding: Encoding, plan: &Plan) -> Option<Vec<u8>> {
        self.encode_laid_out(send, invocation, encoding, plan).map(|(bytes, _)| bytes)
    }

    /// [`PendingRequest::encode`], and where the command's keys and arguments are (for a batch).
    pub fn encode_laid_out(
        &self,
        send: usize,
        invocation: Invocation,
        encoding: Encoding,
        plan: &Plan,
    ) -> Option<(Vec<u8>, Layout)> {
        let send = self.sends.get(send)?;
        // A reservation sized by its request acquires with a template of its own size, built for it; every
        // other call uses its rule's (no template is built, nothing is allocated).
        let sized: Vec<(usize, AcquireTemplate)> = send
            .calls
            .iter()
            .enumerate()
            .filter_map(|(at, &index)| {
                let call = self.calls.get(index)?;
                let template = &plan.rules.get(call.rule)?.template;
                let own = call.permits != template.config().permits || template.config().layout.is_calendar();
                own.then(|| (at, plan.sized(template, call.permits, call.sent_ms)))
            })
            .collect();
        let template_of = |at: usize, call: &RuleCall| match sized.iter().find(|(i, _)| *i == at) {
            Some((_, template)) => Some(template),
            None => plan.rules.get(call.rule).map(|rule| &rule.template),
        };
        if let [only] = send.calls.as_slice() {
            let call = self.calls.get(*only)?;
            let template = template_of(0, call)?;
            return Some(template.encode_laid_out(
                &call.name,
                call.clock,
                &call.member_random,
                call.lease.as_ref(),
                invocation,
                encoding,
            ));
        }
        let mut parts: SmallVec<[AcquirePart<'_>; 2]> = SmallVec::new();
        let mut clock = Clock::Redis;
        for (at, &index) in send.calls.iter().enumerate() {
            let call = self.calls.get(index)?;
            clock = call.clock;
            parts.push(AcquirePart {
                template: template_of(at, call)?,
                name: &call.name,
                random: &call.member_random,
                lease: call.lease.as_ref(),
            });
        }
        Some(encode_acquire_all_laid_out(&parts, clock, plan.errors_stop_charge, invocation, encoding))
    }
}
