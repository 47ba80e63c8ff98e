/* plain AVX-512 sum of 512 MB, 1 and 2 threads, 4 KB pages (arg 0) or MADV_HUGEPAGE (arg 1) */
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <immintrin.h>
#include <omp.h>
#include <time.h>
#include <string.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){ int huge=atoi(argv[1]); size_t bytes=512ul<<20, n=bytes/4;
  float*a=aligned_alloc(2<<20,bytes); if(huge) madvise(a,bytes,MADV_HUGEPAGE);
  for(size_t i=0;i<n;i++)a[i]=1;
  for(int nt=1;nt<=2;nt++){ double best=1e9; float tot=0;
    for(int t=0;t<5;t++){ double t0=now();
      #pragma omp parallel num_threads(nt) reduction(+:tot)
      { __m512 s=_mm512_setzero_ps(), s2=s; int th=omp_get_thread_num();
        size_t lo=n*th/nt, hi=n*(th+1)/nt;
        for(size_t i=lo;i<hi;i+=32){s=_mm512_add_ps(s,_mm512_load_ps(a+i)); s2=_mm512_add_ps(s2,_mm512_load_ps(a+i+16));}
        tot+=_mm512_reduce_add_ps(_mm512_add_ps(s,s2)); }
      double dt=now()-t0; if(dt<best)best=dt;}
    printf("huge %d threads %d: %.1f GB/s (%g)\n", huge, nt, bytes/best/1e9, tot);}
  FILE*f=fopen("/proc/self/smaps_rollup","r"); char l[256]; while(fgets(l,256,f)) if(strstr(l,"AnonHuge")) fputs(l,stdout);
}
