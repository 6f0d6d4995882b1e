/* Wine 8 lacks ProcessPrng in bcryptprimitives.dll, which Rust's std calls at start-up (tests
 * die with c0000135). This stand-in forwards to advapi32's RtlGenRandom; .ci/wine-test builds it
 * as bcryptprimitives.dll and puts it on WINEPATH. Not shipped: Windows itself has ProcessPrng. */
#include <windows.h>
BOOLEAN WINAPI SystemFunction036(PVOID buffer, ULONG length);
BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T len) {
    for (; len > 0x40000000; data += 0x40000000, len -= 0x40000000)
        if (!SystemFunction036(data, 0x40000000)) return FALSE;
    return SystemFunction036(data, (ULONG)len);
}
