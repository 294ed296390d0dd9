/* dlsym for the shim (x86-64 System V). Asks cushare_dlsym_intercept first; if it returns null,
 * tail-jumps to the real dlsym with the caller's arguments and, crucially, the caller's return
 * address, which glibc uses to resolve RTLD_NEXT relative to the caller. A C wrapper calling the
 * real dlsym would make every RTLD_NEXT lookup relative to the shim and break other interposers. */
    .text
    .globl dlsym
    .type dlsym, @function
dlsym:
    .cfi_startproc
    push %rdi
    .cfi_adjust_cfa_offset 8
    push %rsi
    .cfi_adjust_cfa_offset 8
    sub $8, %rsp
    .cfi_adjust_cfa_offset 8
    call cushare_dlsym_intercept
    add $8, %rsp
    .cfi_adjust_cfa_offset -8
    pop %rsi
    .cfi_adjust_cfa_offset -8
    pop %rdi
    .cfi_adjust_cfa_offset -8
    test %rax, %rax
    jnz 1f
    jmp *cushare_real_dlsym(%rip)
1:
    ret
    .cfi_endproc
    .size dlsym, .-dlsym
    .section .note.GNU-stack,"",@progbits
