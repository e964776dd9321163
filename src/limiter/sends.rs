//! How a request's rule calls become Redis calls ([`group`]): all or nothing in one call, one per hash
//! slot with Redis Cluster, shadow rules apart.

use smallvec::SmallVec;

use crate::config::{Mode, PluginConfig};
use crate::key::hash_slot;

use super::pending::{CallState, RuleCall, Send};

/// The Redis calls of a request's waiting rule calls: all in one (all or nothing), or with Redis Cluster one
/// per hash slot of their limiters (a script's keys must share a slot). Shadow rules are checked in calls
/// of their own: a shadow rule that would reject must not keep the enforced rules from taking their permits.
pub(super) fn group(calls: &[RuleCall], config: &PluginConfig) -> SmallVec<[Send; 1]> {
    let mut sends: SmallVec<[Send; 1]> = SmallVec::new();
    let mut slots: SmallVec<[(u16, bool); 2]> = SmallVec::new();
    for (index, call) in calls.iter().enumerate().filter(|(_, c)| c.state == CallState::Waiting) {
        let shadow = config.rules.get(call.rule).is_some_and(|r| r.mode == Mode::Shadow);
        let slot = (if config.redis.redis_cluster { hash_slot(&call.name) } else { 0 }, shadow);
        match slots.iter().position(|&s| s == slot) {
            Some(at) => {
                if let Some(send) = sends.get_mut(at) {
                    send.calls.push(index);
                }
            }
            None => {
                slots.push(slot);
                let mut covered = SmallVec::new();
                covered.push(index);
                sends.push(Send { calls: covered, retried: false, done: false });
            }
        }
    }
    sends
}
