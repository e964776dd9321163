//! Text encodings of bytes. Base64 (RFC 4648): the URL-safe alphabet without padding for limiter names (section 5) and
//! the standard alphabet with padding for HTTP Basic credentials (section 4).
//!
//! Our own, a few lines, instead of the `base64` crate, whose engine costs ~2.5 KB of module for these two
//! calls (docs/deploying.md, "Module size"); the unit tests compare both with the crate.

use crate::prelude::*;

/// The URL-safe alphabet (`-`, `_`).
pub const URL_SAFE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
/// The standard alphabet (`+`, `/`).
pub const STANDARD: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Appends `bytes` in base64 with `alphabet`; `pad`: `=` up to a multiple of 4 characters.
pub fn base64_into(bytes: &[u8], alphabet: &[u8; 64], pad: bool, out: &mut String) {
    let digit = |n: u32| char::from(alphabet.get((n & 63) as usize).copied().unwrap_or(b'A'));
    out.reserve(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = |i: usize| u32::from(chunk.get(i).copied().unwrap_or(0));
        let group = (b(0) << 16) | (b(1) << 8) | b(2);
        let digits = chunk.len() + 1;
        for (index, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if index < digits {
                out.push(digit(group >> shift));
            } else if pad {
                out.push('=');
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine as _;

    #[test]
    fn both_forms_match_the_base64_crate() {
        let url = &base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let standard = &base64::engine::general_purpose::STANDARD;
        for len in 0..70u8 {
            let bytes: Vec<u8> = (0..len).map(|i| i.wrapping_mul(97).wrapping_add(len) ^ 0xa5).collect();
            let mut ours = String::new();
            base64_into(&bytes, URL_SAFE, false, &mut ours);
            assert_eq!(ours, url.encode(&bytes), "{len} bytes, URL-safe");
            let mut ours = String::new();
            base64_into(&bytes, STANDARD, true, &mut ours);
            assert_eq!(ours, standard.encode(&bytes), "{len} bytes, standard");
        }
    }
}
