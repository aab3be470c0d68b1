/* bcryptprimitives.dll for Wine releases that lack it (Debian 12's Wine 8.0).
 *
 * Rust's standard library on Windows draws its random seeds from ProcessPrng, exported by
 * bcryptprimitives.dll since Windows 10; Wine added that DLL after 8.0, so there a Rust
 * program does not load at all (c0000135). This DLL gives ProcessPrng over RtlGenRandom
 * (advapi32's SystemFunction036), which every Wine has. It is for running the Windows
 * build under Wine in CI only (tools/windows_under_wine.sh); it never ships with k3.
 */
#include <windows.h>

BOOLEAN WINAPI SystemFunction036(PVOID buffer, ULONG length);

__declspec(dllexport) BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T len)
{
    while (len > 0) {
        ULONG n = len > 0x10000000 ? 0x10000000 : (ULONG)len;
        if (!SystemFunction036(data, n))
            return FALSE;
        data += n;
        len -= n;
    }
    return TRUE;
}
