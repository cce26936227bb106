/* Issue 14 probe: what bounds a 4096x4096 int4 GEMV (M = 1) on one AVX-512 core.
 *
 * Not part of quantkit; a measurement behind BENCHMARKS.md (issue 14, "why 3x and not 6x").
 * Each mode runs the inner loop over the same 8 MiB of packed int4 weights (one pass = one
 * M = 1 product of a 4096x4096 layer) and prints the best of 30 passes:
 *   0  bf16 dot products (vdpbf16ps, 32 MACs per instruction) on nibbles turned into bf16 by
 *      OR-ing them into the mantissa of 128.0 (0x4300 | q), group scale/zero applied once per
 *      group outside the loop: ~6 vector instructions per 64 weights
 *   1  mode 0's conversion alone, 2  mode 0's dot products alone (no conversion)
 *   3  streaming the int4 bytes only (memory floor)
 *   4  the loop of aten's _weight_int4pack_mm_for_cpu AVX-512 kernel (int4mm_kernel.cpp):
 *      16-entry LUT permute, a dequantizing FMA and an accumulating FMA per 16 weights:
 *      ~16 vector instructions per 64 weights
 * Build and run (gcc >= 10, a CPU with AVX512-BF16):
 *   gcc -O3 -mavx512f -mavx512bw -mavx512bf16 -mavx512vl -mfma benchmarks/int4_cpu_probe.c -o /tmp/probe
 *   for m in 4 0 3 1 2; do /tmp/probe $m; done
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  int64_t N=4096,K=4096; int mode=atoi(argv[1]);
  uint8_t* w=aligned_alloc(64,N*K/2); for(int64_t i=0;i<N*K/2;i++) w[i]=rand();
  float* xf=aligned_alloc(64,K*4); for(int i=0;i<K;i++) xf[i]=1.0f;
  uint16_t* x=aligned_alloc(64,K*2); for(int i=0;i<K;i++) x[i]=0x3f80;
  static float out[64*16];
  const __m512i mag=_mm512_set1_epi16(0x4300), lo4=_mm512_set1_epi16(0xF);
  double best=1e9;
  for(int rep=0;rep<30;rep++){
    double t0=now();
    __m512 acc[8]; for(int i=0;i<8;i++) acc[i]=_mm512_setzero_ps();
    for(int64_t ng=0;ng<N/64;ng++){
      const uint8_t* wb=w+ng*(K/4)*128;
      for(int64_t kq=0;kq<K/4;kq++){
        __m512i xb=_mm512_set1_epi32(*(const int*)(x+4*kq));
        __m512i xb2=_mm512_set1_epi32(*(const int*)(x+4*kq+2));
        for(int b=0;b<4;b++){
          if(mode==0){ // full
            __m512i v=_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(wb+128*kq+32*b)));
            __m512i lo=_mm512_ternarylogic_epi32(v,lo4,mag,0xEA);
            __m512i hi=_mm512_or_si512(_mm512_srli_epi16(v,4),mag);
            acc[2*b]=_mm512_dpbf16_ps(acc[2*b],(__m512bh)lo,(__m512bh)xb);
            acc[2*b+1]=_mm512_dpbf16_ps(acc[2*b+1],(__m512bh)hi,(__m512bh)xb2);
          } else if(mode==1){ // no dp: just load+convert, xor into acc
            __m512i v=_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(wb+128*kq+32*b)));
            __m512i lo=_mm512_ternarylogic_epi32(v,lo4,mag,0xEA);
            __m512i hi=_mm512_or_si512(_mm512_srli_epi16(v,4),mag);
            acc[2*b]=_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(acc[2*b]),lo));
            acc[2*b+1]=_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(acc[2*b+1]),hi));
          } else if(mode==2){ // dp only on loaded raw 64B (reads 2x bytes)
            __m512i v=_mm512_loadu_si512((const void*)(wb+128*kq+32*b- (b&1)*32));
            acc[2*b]=_mm512_dpbf16_ps(acc[2*b],(__m512bh)v,(__m512bh)xb);
            acc[2*b+1]=_mm512_dpbf16_ps(acc[2*b+1],(__m512bh)v,(__m512bh)xb2);
          } else if(mode==4){ // aten-like: LUT permute, dequant fma, acc fma (16 weights per zmm)
            const __m512 lut=_mm512_set_ps(7,6,5,4,3,2,1,0,-1,-2,-3,-4,-5,-6,-7,-8);
            __m512 va=_mm512_set1_ps(xf[4*kq+b]);
            __m256i b4=_mm256_loadu_si256((const __m256i*)(wb+128*kq+32*b));
            __m512i b32=_mm512_cvtepu8_epi32(_mm256_castsi256_si128(b4));
            __m512 sc=_mm512_set1_ps(0.5f), zz=_mm512_set1_ps(0.25f);
            __m512 v0=_mm512_fmadd_ps(_mm512_permutexvar_ps(b32,lut),sc,zz);
            __m512 v2=_mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b32,4),lut),sc,zz);
            b32=_mm512_cvtepu8_epi32(_mm256_extracti128_si256(b4,1));
            __m512 v1=_mm512_fmadd_ps(_mm512_permutexvar_ps(b32,lut),sc,zz);
            __m512 v3=_mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b32,4),lut),sc,zz);
            acc[0]=_mm512_fmadd_ps(va,v0,acc[0]); acc[1]=_mm512_fmadd_ps(va,v1,acc[1]);
            acc[2]=_mm512_fmadd_ps(va,v2,acc[2]); acc[3]=_mm512_fmadd_ps(va,v3,acc[3]);
          } else { // only load/or memory bandwidth
            __m256i v=_mm256_loadu_si256((const __m256i*)(wb+128*kq+32*b));
            acc[b]=_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(acc[b]),_mm512_castsi256_si512(v)));
          }
        }
      }
      for(int i=0;i<8;i++) _mm512_storeu_ps(out+16*(i%8),acc[i]);
    }
    double t=now()-t0; if(t<best)best=t; volatile float sink=out[rep%64];(void)sink;
  }
  const char* names[]={"dpbf16 (factored scales)","convert only","dpbf16 only","int4 stream only","aten-like LUT+2 FMA"};
  double bytes = N*K/2.0;
  printf("%-26s best %.3f ms  %.1f GB/s  %.2f weights/ns\n",names[mode],best*1e3,bytes/best/1e9,N*K/best/1e9);
}
