# One device call (from the repo root): decode_gemm.py at the column-tile widths between 64 and 128 that make the
# projections one CTA an SM (#18 session 28; BENCHMARKS.md). ~40 s on a warm machine. JSON: $OUT/gemm_s28_*.json.
source benchmarks/gpu_env.sh
python3 benchmarks/decode_gemm.py --models llama-8b --parts gate_up_act --configs 'tile_n=128,num_stages=4;tile_n=112,num_stages=4;tile_n=112,num_stages=5;tile_n=128,num_stages=4' --out $OUT/gemm_s28_8b_gate.json 2>&1 | grep -v Warn | tail -3
python3 benchmarks/decode_gemm.py --models llama-8b --parts qkv,o --configs 'tile_n=64;tile_n=96,k_splits=2;tile_n=48,k_splits=1;tile_n=48,k_splits=2;tile_n=128,k_splits=2;tile_n=64' --out $OUT/gemm_s28_8b_qkv.json 2>&1 | grep -v Warn | tail -4
python3 benchmarks/decode_gemm.py --models llama-1b --parts qkv,o,down --configs 'tile_n=64;tile_n=96,k_splits=4;tile_n=48,k_splits=2;tile_n=32,k_splits=2;tile_n=64' --out $OUT/gemm_s28_1b.json 2>&1 | grep -v Warn | tail -5
