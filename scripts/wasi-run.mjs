// Runs a wasm32-wasip1 program (a test binary of `make test-wasm`) under Node's WASI (preview1), as cargo's
// runner for that target: `node scripts/wasi-run.mjs PROGRAM.wasm ARGS...`. The program sees ARGS and the
// environment, writes to this process's stdout and stderr, and its exit code is this process's.
//
// Node's `node:wasi` (https://nodejs.org/api/wasi.html, `version: 'preview1'`, `getImportObject()` since
// v19.8) is enough for Rust's libtest on wasip1: it runs the tests one after the other (no threads), and a
// panic aborts the program (wasm has no unwinding), which fails the run.
import { readFile } from 'node:fs/promises';
import { WASI } from 'node:wasi';

const [program, ...args] = process.argv.slice(2);
if (!program) {
  console.error('usage: node scripts/wasi-run.mjs PROGRAM.wasm [ARGS...]');
  process.exit(2);
}
const wasi = new WASI({ version: 'preview1', args: [program, ...args], env: process.env, returnOnExit: true });
const module = await WebAssembly.compile(await readFile(program));
const instance = await WebAssembly.instantiate(module, wasi.getImportObject());
process.exitCode = wasi.start(instance);
