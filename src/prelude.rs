//! What `std`'s prelude would give a `no_std` crate: the `alloc` types every module uses.

pub(crate) use alloc::format;
pub(crate) use alloc::string::{String, ToString};
pub(crate) use alloc::vec;
pub(crate) use alloc::vec::Vec;
