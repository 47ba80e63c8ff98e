# usage: bash build.sh DIR: the kernel library of DIR (a copy of tokenmill/layers/*.c, *.h and quant/*.c) as DIR/lib.so, AVX-512 VNNI build
gcc -O3 -mavx2 -mfma -mf16c -fopenmp -shared -fPIC -mavx512f -mavx512bw -mavx512vl -mavx512vnni $1/cpu_kernels.c -o $1/lib.so -lm
