/* driver_symbols.h: the CUDA driver's entry points read from the loaded
 * library's own dynamic symbol table, never asking dlsym or
 * cuGetProcAddress: what a program that means to get past an interposer
 * does. For the test programs (probe's `elf` access, workload's
 * WORKLOAD_DRIVER=elf); load libcuda.so.1 first (dlopen). */
#ifndef VGPU_TEST_DRIVER_SYMBOLS_H
#define VGPU_TEST_DRIVER_SYMBOLS_H

#define _GNU_SOURCE
#include <elf.h>
#include <link.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The driver as loaded: where it is mapped and its dynamic symbol table,
 * found by walking the program headers of the loaded objects. */
static struct {
    ElfW(Addr) base;
    const ElfW(Sym) *symbols;
    const char *names;
    size_t count;
} elf_driver;

__attribute__((unused)) static int find_driver_object(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    (void)data;
    if (!info->dlpi_name || !strstr(info->dlpi_name, "libcuda.so")) return 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        if (info->dlpi_phdr[i].p_type != PT_DYNAMIC) continue;
        const ElfW(Dyn) *dyn = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
        const uint32_t *gnu_hash = NULL;
        const uint32_t *sysv_hash = NULL;
        for (; dyn->d_tag != DT_NULL; dyn++) {
            /* The loader has relocated these to addresses already. */
            if (dyn->d_tag == DT_SYMTAB) elf_driver.symbols = (const ElfW(Sym) *)dyn->d_un.d_ptr;
            if (dyn->d_tag == DT_STRTAB) elf_driver.names = (const char *)dyn->d_un.d_ptr;
            if (dyn->d_tag == DT_GNU_HASH) gnu_hash = (const uint32_t *)dyn->d_un.d_ptr;
            if (dyn->d_tag == DT_HASH) sysv_hash = (const uint32_t *)dyn->d_un.d_ptr;
        }
        if (sysv_hash) {
            elf_driver.count = sysv_hash[1];
        } else if (gnu_hash) {
            /* The highest symbol index any bucket's chain reaches. */
            uint32_t buckets = gnu_hash[0], offset = gnu_hash[1], bloom = gnu_hash[2];
            const uint32_t *bucket = gnu_hash + 4 + bloom * (sizeof(ElfW(Addr)) / 4);
            const uint32_t *chain = bucket + buckets;
            uint32_t last = 0;
            for (uint32_t b = 0; b < buckets; b++)
                if (bucket[b] > last) last = bucket[b];
            if (last >= offset)
                while (!(chain[last - offset] & 1)) last++;
            elf_driver.count = last + 1;
        }
        elf_driver.base = info->dlpi_addr;
        return 1;
    }
    return 0;
}

/* Finds the loaded driver's symbol table; 0 when there is none. */
__attribute__((unused)) static int find_driver_symbols(void) {
    dl_iterate_phdr(find_driver_object, NULL);
    return elf_driver.symbols && elf_driver.names && elf_driver.count;
}

__attribute__((unused)) static void *elf_lookup(const char *name) {
    for (size_t i = 0; i < elf_driver.count; i++) {
        const ElfW(Sym) *sym = &elf_driver.symbols[i];
        if (sym->st_value && ELF64_ST_TYPE(sym->st_info) == STT_FUNC &&
            strcmp(elf_driver.names + sym->st_name, name) == 0)
            return (void *)(elf_driver.base + sym->st_value);
    }
    return NULL;
}

#endif
