/* dlsym, dlvsym and dlmopen for the shim (x86-64 System V). glibc resolves RTLD_NEXT, and finds the
 * RUNPATH a bare library name is searched along, from the return address of the call into it: a C
 * wrapper calling the real function would make every such lookup relative to the shim and break
 * other interposers. So these entry points ask the shim first and, when it leaves the call to
 * glibc, tail-jump to the real function with the caller's arguments and return address.
 *
 * dlsym, dlvsym: cushare_dlsym_intercept / cushare_dlvsym_intercept return the shim's answer, or
 * null to leave the lookup to glibc. */
    .text

/* Calls fn with the caller's first three arguments and keeps them for the tail jump (three pushes
 * also realign the stack for the call). */
.macro CUSHARE_CALL_KEEPING_ARGS fn
    push %rdi
    .cfi_adjust_cfa_offset 8
    push %rsi
    .cfi_adjust_cfa_offset 8
    push %rdx
    .cfi_adjust_cfa_offset 8
    call \fn
    pop %rdx
    .cfi_adjust_cfa_offset -8
    pop %rsi
    .cfi_adjust_cfa_offset -8
    pop %rdi
    .cfi_adjust_cfa_offset -8
.endm

.macro CUSHARE_DL_LOOKUP name, intercept, real
    .globl \name
    .type \name, @function
\name:
    .cfi_startproc
    CUSHARE_CALL_KEEPING_ARGS \intercept
    test %rax, %rax
    jz 1f
    ret
1:
    jmp *\real(%rip)
    .cfi_endproc
    .size \name, .-\name
.endm

CUSHARE_DL_LOOKUP dlsym, cushare_dlsym_intercept, cushare_real_dlsym
CUSHARE_DL_LOOKUP dlvsym, cushare_dlvsym_intercept, cushare_real_dlvsym

/* dlmopen: cushare_dlmopen_route(nsid, file, mode) returns where the call goes: the real dlmopen
 * (the base namespace, where the preloaded shim is: nothing to do) or cushare_dlmopen_other, which
 * loads into another namespace and checks what it loaded. Jumped to, not called: the caller's
 * return address stays on the stack for either. */
    .globl dlmopen
    .type dlmopen, @function
dlmopen:
    .cfi_startproc
    CUSHARE_CALL_KEEPING_ARGS cushare_dlmopen_route
    jmp *%rax
    .cfi_endproc
    .size dlmopen, .-dlmopen
    .section .note.GNU-stack,"",@progbits
