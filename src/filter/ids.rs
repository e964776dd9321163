//! The identities the filter writes into Redis: this gateway process's Redisson client id (the suffix of
//! PER_CLIENT keys, shared by all VMs of the process through shared data), the random bytes of each
//! permit member, and the ids of in-flight permits.

use alloc::rc::Rc;

use crate::prelude::*;

use crate::host::{Host, HostError, LogLevel};
use crate::limiter::Plan;
use crate::script::{MEMBER_RANDOM_LEN, PERMIT_ID_LEN};

use super::{log, Filter};

/// Shared-data key of this gateway process's Redisson client id (shared by all VMs of the process).
pub const CLIENT_ID_KEY: &str = "edge_rate_limiter.client_id";

/// The random part of a permit member: 16 letters and digits (webdis's path form carries them as they
/// are), 8 base-62 digits from each of two random u64 (95 bits of randomness; Redisson uses 16 random bytes:
/// members only need to differ between the acquires of one window).
pub(super) fn member_random(random: &mut fastrand::Rng) -> [u8; MEMBER_RANDOM_LEN] {
    const DIGITS: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let mut bytes = [0u8; MEMBER_RANDOM_LEN];
    for half in bytes.chunks_mut(8) {
        let mut word = random.u64(..);
        for byte in half {
            *byte = DIGITS.get((word % 62) as usize).copied().unwrap_or(b'0');
            word /= 62;
        }
    }
    bytes
}

/// The first half of this process's in-flight permit ids: the first 8 bytes of its client id (a UUID: its
/// first 16 hex digits), computed when the client id is known. The permits of one gateway process share it,
/// and `erl-admin show` groups them by it; Redisson's own ids are 16 random bytes.
pub(super) fn permit_prefix(client_id: &str) -> [u8; PERMIT_ID_LEN / 2] {
    let mut prefix = [0u8; PERMIT_ID_LEN / 2];
    let nibbles = client_id.bytes().filter_map(|c| char::from(c).to_digit(16)).take(PERMIT_ID_LEN);
    for (index, nibble) in nibbles.enumerate() {
        if let Some(byte) = prefix.get_mut(index / 2) {
            *byte = (*byte << 4) | nibble as u8;
        }
    }
    prefix
}

/// An in-flight permit's id (16 bytes, raw in Redis, as Redisson's): `prefix` ([`permit_prefix`]), then 8
/// random bytes.
pub(super) fn permit_id(prefix: &[u8; PERMIT_ID_LEN / 2], random: &mut fastrand::Rng) -> [u8; PERMIT_ID_LEN] {
    let mut id = [0u8; PERMIT_ID_LEN];
    random.fill(&mut id);
    if let Some(head) = id.get_mut(..prefix.len()) {
        head.copy_from_slice(prefix);
    }
    id
}

/// This process's Redisson client id: the one in shared data, or a new random UUID (version 4) published
/// there. Redisson uses its client instance's UUID string the same way (PER_CLIENT keys).
pub(super) fn client_id(host: &impl Host, random: &mut fastrand::Rng) -> String {
    if let Ok((Some(stored), _)) = host.get_shared_data(CLIENT_ID_KEY) {
        if let Ok(stored) = String::from_utf8(stored) {
            return stored;
        }
    }
    let mut bytes = [0u8; 16];
    random.fill(&mut bytes);
    let id = uuid_v4(bytes);
    if let Err(error) = host.set_shared_data(CLIENT_ID_KEY, id.as_bytes(), 0) {
        if error != HostError::CasMismatch {
            log(host, LogLevel::Warn, &format!("cannot publish the client id in shared data: {error}"));
        }
    }
    id
}

/// A random UUID (RFC 9562 version 4) from 16 random bytes, in the hyphenated lowercase form.
fn uuid_v4(mut bytes: [u8; 16]) -> String {
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let mut out = String::with_capacity(36);
    for (index, &byte) in bytes.iter().enumerate() {
        if matches!(index, 4 | 6 | 8 | 10) {
            out.push('-');
        }
        out.push(char::from(crate::quote::hex_digit(byte >> 4, b'a')));
        out.push(char::from(crate::quote::hex_digit(byte, b'a')));
    }
    out
}

impl<H: Host> Filter<H> {
    /// VMs may have raced to publish their client id while starting; by the first request the stored one
    /// is final, so each VM adopts it once (its routes' commands are prepared again with it).
    pub(super) fn confirm_client_id(&mut self) {
        if self.client_id_confirmed {
            return;
        }
        self.client_id_confirmed = true;
        let Ok((Some(stored), _)) = self.host.get_shared_data(CLIENT_ID_KEY) else { return };
        let Ok(stored) = String::from_utf8(stored) else { return };
        if stored == self.client_id {
            return;
        }
        self.permit_prefix = permit_prefix(&stored);
        let routes = self.routes.global.iter_mut().chain(self.routes.overrides.iter_mut().map(|o| &mut o.config));
        // No request holds a route yet: this is the first request.
        for route in routes.filter_map(Rc::get_mut) {
            route.plan = Plan::new(&route.config, &stored);
        }
        self.client_id = stored;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn a_permit_id_starts_with_the_processes_client_id_and_ends_random() {
        let mut random = fastrand::Rng::with_seed(7);
        let prefix = permit_prefix("0123abcd-ef45-4678-9abc-def012345678");
        let (a, b) = (permit_id(&prefix, &mut random), permit_id(&prefix, &mut random));
        assert_eq!(a[..8], [0x01, 0x23, 0xab, 0xcd, 0xef, 0x45, 0x46, 0x78]);
        assert_eq!(a[..8], b[..8]);
        assert_ne!(a[8..], b[8..]);
    }
}
