//! Guest memory as the hostcalls see it: bounds-checked reads and writes (a bad pointer is the status
//! `InvalidMemoryAccess`, as in proxy-wasm-cpp-host, never a host panic) and allocation through the guest's
//! own allocator (`proxy_on_memory_allocate`, or `malloc`), as `WasmBase::allocMemory` does.

use crate::engine::Caller;

use crate::abi::{Status, Stop};
use crate::vm::VmState;

/// Reads `len` bytes at `ptr`.
pub fn read(caller: &mut Caller<'_, VmState>, ptr: u32, len: u32) -> Result<Vec<u8>, Status> {
    let memory = caller.data().memory.ok_or(Status::InvalidMemoryAccess)?;
    let start = usize::try_from(ptr).map_err(|_| Status::InvalidMemoryAccess)?;
    let len = usize::try_from(len).map_err(|_| Status::InvalidMemoryAccess)?;
    let end = start.checked_add(len).ok_or(Status::InvalidMemoryAccess)?;
    memory.data(&*caller).get(start..end).map(<[u8]>::to_vec).ok_or(Status::InvalidMemoryAccess)
}

/// Writes `bytes` at `ptr`.
pub fn write(caller: &mut Caller<'_, VmState>, ptr: u32, bytes: &[u8]) -> Result<(), Status> {
    let memory = caller.data().memory.ok_or(Status::InvalidMemoryAccess)?;
    let start = usize::try_from(ptr).map_err(|_| Status::InvalidMemoryAccess)?;
    let end = start.checked_add(bytes.len()).ok_or(Status::InvalidMemoryAccess)?;
    memory.data_mut(&mut *caller).get_mut(start..end).ok_or(Status::InvalidMemoryAccess)?.copy_from_slice(bytes);
    Ok(())
}

/// Writes a little-endian u32 at `ptr`.
pub fn write_u32(caller: &mut Caller<'_, VmState>, ptr: u32, value: u32) -> Result<(), Status> {
    write(caller, ptr, &value.to_le_bytes())
}

/// Writes a little-endian u64 at `ptr`.
pub fn write_u64(caller: &mut Caller<'_, VmState>, ptr: u32, value: u64) -> Result<(), Status> {
    write(caller, ptr, &value.to_le_bytes())
}

/// Copies `bytes` into a fresh guest allocation and stores its address and size at `ptr_ptr` and
/// `size_ptr` (cpp-host `copyToPointerSize`; empty data stores 0 and 0 without allocating, which the Rust
/// SDK reads as "none").
///
/// # Errors
/// [`Stop::Status`] `InvalidMemoryAccess` for a bad pointer or a failed allocation; [`Stop::Trap`] for a
/// trap inside the guest's allocator, so that the hostcall fails the VM.
pub fn copy_out(caller: &mut Caller<'_, VmState>, bytes: &[u8], ptr_ptr: u32, size_ptr: u32) -> Result<(), Stop> {
    let size = u32::try_from(bytes.len()).map_err(|_| Status::InvalidMemoryAccess)?;
    let mut address = 0;
    if size > 0 {
        address = allocate(caller, size)?.ok_or(Status::InvalidMemoryAccess)?;
        write(caller, address, bytes)?;
    }
    write_u32(caller, ptr_ptr, address)?;
    Ok(write_u32(caller, size_ptr, size)?)
}

/// Allocates `size` bytes in the guest; `None` if the allocator returned 0 or there is none.
pub fn allocate(caller: &mut Caller<'_, VmState>, size: u32) -> Result<Option<u32>, crate::engine::Error> {
    let Some(alloc) = caller.data().alloc.clone() else {
        return Ok(None);
    };
    let address = alloc.call(&mut *caller, size)?;
    Ok((address != 0).then_some(address))
}
