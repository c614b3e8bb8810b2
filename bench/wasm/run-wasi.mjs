// Runs a wasm32-wasip1 program under `node:wasi` (V8, the wasm engine of
// Envoy's filters), in Deno or in Node:
//
//   deno run -A --v8-flags=--no-liftoff run-wasi.mjs PROGRAM.wasm [ARGS...]
//   node --no-liftoff --single-threaded-gc run-wasi.mjs PROGRAM.wasm [ARGS...]
//
// Deno 2.9 (`pip install deno`) carries V8 15.0, closer to Envoy 1.40's V8
// 14.6 than Node 20's 11.3 (bench/README.md, "Core microbenchmarks").
//
// `--no-liftoff` compiles optimized code up front, as Envoy's V8 does.
// `--single-threaded-gc`: Node 20's V8 (11.3) crashed (SIGSEGV) on returning
// from a program whose memory had grown to hundreds of MB, with the default
// concurrent collector. Used for `core/examples/timings.rs` (bench/README.md,
// "Core microbenchmarks").
import { readFile } from 'node:fs/promises';
import { WASI } from 'node:wasi';

const [program, ...args] = process.argv.slice(2);
if (!program) {
  console.error('usage: node --no-liftoff --single-threaded-gc run-wasi.mjs PROGRAM.wasm [ARGS...]');
  process.exit(2);
}
const wasi = new WASI({ version: 'preview1', args: [program, ...args] });
const module = await WebAssembly.compile(await readFile(program));
const instance = await WebAssembly.instantiate(module, wasi.getImportObject());
process.exitCode = wasi.start(instance);
