/* msvc_prelude.h — included first when tests/test_windows_build.py parses the csrc headers in
 * clang's MSVC mode (--target=x86_64-pc-windows-msvc, -fsyntax-only). There is no Windows SDK
 * here: MinGW's C library headers stand in for it, and this prelude makes them parse outside GCC
 * mode, then poisons the GCC-only syntax MSVC's C compiler rejects, so that any use of it outside an
 * `#if defined(__GNUC__)` guard in our code is an error.
 *
 * Order matters: clang's own intrinsic headers (which use __attribute__) come first; then MinGW's
 * _mingw.h, which defines __attribute__ away when __GNUC__ is not set and spells two attributes
 * in a position clang rejects; then the poison. */
#include <intrin.h>
#include <immintrin.h>
#include <_mingw.h>
#undef __MINGW_ATTRIB_NORETURN
#define __MINGW_ATTRIB_NORETURN
#undef __MINGW_ATTRIB_DEPRECATED
#define __MINGW_ATTRIB_DEPRECATED
#include <malloc.h>                  /* the C library, whose GNU-mode code clang's headers reach */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <windows.h>

/* MSVC defines neither __GNUC__ nor __clang__: our guards must see what cl.exe shows them. */
#pragma clang diagnostic ignored "-Wbuiltin-macro-redefined"
#undef __clang__

/* MSVC has no GNU attributes, inline assembly, __thread, 128-bit integers or GCC builtins.
 * (__typeof__ is left alone: MinGW's math.h classification macros expand to it in our code.) */
#undef __attribute__
#define __attribute__(x) gcc_only_attribute_outside_a_GNUC_guard
#pragma GCC poison __asm__ asm __asm __thread __int128 __builtin_expect __builtin_prefetch __builtin_ctz __builtin_clz __builtin_popcount __builtin_unreachable __builtin_assume_aligned
