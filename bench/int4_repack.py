"""What one expert miss costs on this CPU: O_DIRECT read, CRC-32, repack (learned shuffle vs converter).

For each CPU capability this machine can run (default, avx2, avx512: torch dispatches as told by
ATEN_CPU_CAPABILITY), a child process builds one NanoColibri and one Colibri-Micro expert blob
(genuinely quantized random weights), writes it to a file on --dir, and then, interleaved over
--repeats rounds so that load drifts hit both routes alike:

  read_ms       one aligned preadv of the blob with O_DIRECT (page cache dropped, as a miss)
  crc_ms        ExpertBlob.parse with its CRC-32 check
  shuffle_ms    Int4Expert(blob): repack by the shuffle layout learned on this machine
  converter_ms  Int4Expert(blob) with the converter forced (the route before the learned layout)
  native_ms     NativeQ4Expert(blob) + its copy into a slab slot: the native kernel computes from
                the container's layout, so preparing is a copy of what was read

and prints medians plus the ratios that matter: converter / shuffle, and (crc + prepare) / read
for torch's kernel (shuffle) and for the native one, which is about 1 when a miss costs about its
read. One JSON object per capability, one line each.

    python bench/int4_repack.py [--repeats 9] [--dir /var/tmp] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

SHAPES = {"nano": (1024, 512), "micro": (1536, 768)}  # d_model, expert_dim


def _measure(capability: str, repeats: int, directory: str, threads: int) -> dict:
    import numpy as np
    import torch
    from colibri_int4 import ExpertBlob, ExpertBlobLayout, ModelShape, QuantScheme, encode_expert_blob
    from colibri_model import ExpertGlu, checkpoint_config_dict, get_preset
    from colibri_stream.compute import int4_repack
    from colibri_stream.compute.expert_compute import Int4Expert
    from colibri_stream.compute.native_expert import NativeQ4Expert
    from colibri_stream.io.direct_io import AlignedBuffer, BlobReader

    torch.set_num_threads(threads)
    out = {"capability": torch.backends.cpu.get_cpu_capability(), "threads": threads, "repeats": repeats}
    for name, (d_model, expert_dim) in SHAPES.items():
        config = checkpoint_config_dict(get_preset(name))
        layout = ExpertBlobLayout.build(ModelShape.model_validate(config), QuantScheme(group_size=64))
        rng = np.random.default_rng(0)
        gate, up = (rng.standard_normal((expert_dim, d_model), dtype=np.float32) for _ in range(2))
        down = rng.standard_normal((d_model, expert_dim), dtype=np.float32)
        blob_bytes = encode_expert_blob(gate, up, down, layout, QuantScheme(group_size=64))
        crc = f"{zlib.crc32(blob_bytes):08x}"
        with tempfile.NamedTemporaryFile(dir=directory, suffix=".blob", delete=False) as f:
            f.write(blob_bytes)
            path = f.name
        reader = BlobReader(path)
        buffer = AlignedBuffer(layout.blob_length)
        times = {"read_ms": [], "crc_ms": [], "shuffle_ms": [], "converter_ms": [], "native_ms": []}
        slot = None
        learned = {shape: int4_repack.layout_for(*shape) for shape in ((2 * expert_dim, d_model), (d_model, expert_dim))}
        try:
            for _ in range(repeats):
                started = time.perf_counter()
                reader.read_into(buffer.view, 0, layout.blob_length)
                times["read_ms"].append(time.perf_counter() - started)
                started = time.perf_counter()
                blob = ExpertBlob.parse(buffer.view, layout, crc)
                times["crc_ms"].append(time.perf_counter() - started)
                for route in ("shuffle_ms", "converter_ms"):
                    int4_repack._layouts.update(learned if route == "shuffle_ms" else dict.fromkeys(learned))
                    started = time.perf_counter()
                    Int4Expert(blob)
                    times[route].append(time.perf_counter() - started)
                started = time.perf_counter()
                expert = NativeQ4Expert(blob, ExpertGlu())
                slot = torch.empty(expert.nbytes, dtype=torch.uint8) if slot is None else slot
                expert.move_into(slot)  # a warm slot, as in a full cache's eviction
                times["native_ms"].append(time.perf_counter() - started)
                del blob, expert
        finally:
            int4_repack._layouts.update(learned)
            reader.close()
            os.unlink(path)
        medians = {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()}
        medians["io_mode"] = reader.mode
        medians["blob_mb"] = round(layout.blob_length / 1e6, 2)
        medians["shuffle_taken"] = all(v is not None for v in learned.values())
        medians["converter_over_shuffle"] = round(medians["converter_ms"] / medians["shuffle_ms"], 2)
        medians["prepare_over_read"] = round((medians["crc_ms"] + medians["shuffle_ms"]) / medians["read_ms"], 2)
        medians["native_prepare_over_read"] = round((medians["crc_ms"] + medians["native_ms"]) / medians["read_ms"], 2)
        medians["prepare_over_read_before"] = round(
            (medians["crc_ms"] + medians["converter_ms"]) / medians["read_ms"], 2
        )
        out[name] = medians
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dir", default="/var/tmp", help="where the blob file goes (not tmpfs: reads must reach storage)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the engine's model thread)")
    parser.add_argument("--capability", help=argparse.SUPPRESS)  # the child's side
    args = parser.parse_args()
    if args.capability:
        print(json.dumps(_measure(args.capability, args.repeats, args.dir, args.threads)))
        return
    from colibri_stream.compute.cpu_capability import supported_capabilities

    for capability in supported_capabilities():
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
        cmd = [sys.executable, __file__, "--capability", capability, "--repeats", str(args.repeats),
               "--dir", args.dir, "--threads", str(args.threads)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{capability}: {done.stderr.strip().splitlines()[-1]}")
        print(done.stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
