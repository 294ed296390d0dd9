// Fatbin and cubin parsing (see fatbin.h). Layouts: the fatbin container is a 16-byte header
// (magic, version, header size, payload size) followed by entries, each with its own header
// (kind 2 = ELF cubin, payload size at +8, header size at +4). Cubin kernels carry their
// parameters in ".nv.info.<kernel>" sections as EIATTR_KPARAM_INFO (0x17) records: ordinal at
// +4, offset at +6, and the size in bits 18..31 of the word at +8. Register counts are in the
// module-wide ".nv.info" section as EIATTR_REGCOUNT (0x2f) records {symbol index, registers};
// static shared memory is the size of the ".nv.shared.<kernel>" section. PTX text: each .entry's
// declared parameters (parsePtx).
#include "fatbin.h"

#include <elf.h>

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace simgpu {
namespace {

constexpr uint32_t kWrapperMagic = 0x466243b1;
constexpr uint32_t kFatbinMagic = 0xBA55ED50;
constexpr uint8_t kKparamInfo = 0x17;
constexpr uint8_t kRegCount = 0x2f;

template <typename T>
T load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Module-wide .nv.info: register counts by symbol index.
void parseModuleInfo(const char* p, size_t n, std::map<uint32_t, uint32_t>* regs) {
  size_t i = 0;
  while (i + 4 <= n) {
    const uint8_t fmt = static_cast<uint8_t>(p[i]);
    const uint8_t attr = static_cast<uint8_t>(p[i + 1]);
    if (fmt != 0x04) {
      i += 4;
      continue;
    }
    const uint16_t sz = load<uint16_t>(p + i + 2);
    if (i + 4 + sz > n) return;
    if (attr == kRegCount && sz >= 8) (*regs)[load<uint32_t>(p + i + 4)] = load<uint32_t>(p + i + 8);
    i += 4 + sz;
  }
}

void parseNvInfo(const char* p, size_t n, std::vector<ParamInfo>* params) {
  size_t i = 0;
  while (i + 4 <= n) {
    const uint8_t fmt = static_cast<uint8_t>(p[i]);
    const uint8_t attr = static_cast<uint8_t>(p[i + 1]);
    if (fmt == 0x04) {  // EIFMT_SVAL: u16 size, then payload
      const uint16_t sz = load<uint16_t>(p + i + 2);
      if (i + 4 + sz > n) return;
      if (attr == kKparamInfo && sz >= 12) {
        const char* q = p + i + 4;
        const uint16_t ordinal = load<uint16_t>(q + 4);
        const uint16_t offset = load<uint16_t>(q + 6);
        const uint32_t bits = load<uint32_t>(q + 8);
        const uint32_t size = bits >> 18;
        if (params->size() <= ordinal) params->resize(ordinal + 1u, ParamInfo{0, 0});
        (*params)[ordinal] = ParamInfo{offset, size};
      }
      i += 4 + sz;
    } else {
      i += 4;  // EIFMT_NVAL/BVAL/HVAL: fixed 4 bytes
    }
  }
}

void parseElf(const char* e, size_t n, ImageInfo* out) {
  if (n < sizeof(Elf64_Ehdr)) return;
  const auto eh = load<Elf64_Ehdr>(e);
  if (eh.e_ident[EI_CLASS] != ELFCLASS64 || eh.e_shentsize != sizeof(Elf64_Shdr)) return;
  if (eh.e_shoff + static_cast<size_t>(eh.e_shnum) * sizeof(Elf64_Shdr) > n || eh.e_shstrndx >= eh.e_shnum) return;
  auto sh = [&](int i) { return load<Elf64_Shdr>(e + eh.e_shoff + static_cast<size_t>(i) * sizeof(Elf64_Shdr)); };
  const Elf64_Shdr strs = sh(eh.e_shstrndx);
  if (strs.sh_offset + strs.sh_size > n) return;
  std::map<uint32_t, uint32_t> regsBySymbol;
  std::map<uint32_t, std::string> functionsBySymbol;
  for (int i = 0; i < eh.e_shnum; ++i) {
    const Elf64_Shdr s = sh(i);
    if (s.sh_name >= strs.sh_size) continue;
    if (s.sh_type != SHT_NOBITS && s.sh_offset + s.sh_size > n) continue;  // NOBITS (shared memory) has no bytes
    const char* name = e + strs.sh_offset + s.sh_name;
    if (std::strncmp(name, ".nv.info.", 9) == 0) {
      std::vector<ParamInfo>& params = out->kernels[name + 9];
      params.clear();
      parseNvInfo(e + s.sh_offset, s.sh_size, &params);
    } else if (std::strcmp(name, ".nv.info") == 0) {
      parseModuleInfo(e + s.sh_offset, s.sh_size, &regsBySymbol);
    } else if (std::strncmp(name, ".nv.shared.", 11) == 0 && std::strncmp(name, ".nv.shared.reserved", 19) != 0) {
      out->resources[name + 11].staticShared = static_cast<uint32_t>(s.sh_size);
    } else if (s.sh_type == SHT_SYMTAB && s.sh_entsize == sizeof(Elf64_Sym) && s.sh_link < eh.e_shnum) {
      out->globalsKnown = true;  // the symbol table lists the cubin's globals
      const Elf64_Shdr symstr = sh(static_cast<int>(s.sh_link));
      if (symstr.sh_offset + symstr.sh_size > n) continue;
      for (size_t k = 0; k < s.sh_size / sizeof(Elf64_Sym); ++k) {
        const auto sym = load<Elf64_Sym>(e + s.sh_offset + k * sizeof(Elf64_Sym));
        if (sym.st_name >= symstr.sh_size) continue;
        const char* sn = e + symstr.sh_offset + sym.st_name;
        if (ELF64_ST_TYPE(sym.st_info) == STT_OBJECT && *sn) out->globals[sn] = sym.st_size;
        if (ELF64_ST_TYPE(sym.st_info) == STT_FUNC && *sn) functionsBySymbol[static_cast<uint32_t>(k)] = sn;
        if (ELF64_ST_TYPE(sym.st_info) == STT_FUNC && *sn && ELF64_ST_BIND(sym.st_info) == STB_GLOBAL)
          out->kernels.try_emplace(sn);
      }
    }
  }
  for (const auto& [sym, regs] : regsBySymbol)
    if (auto f = functionsBySymbol.find(sym); f != functionsBySymbol.end()) out->resources[f->second].registers = regs;
}

void parseFatbin(const char* f, ImageInfo* out) {
  const uint16_t headerSize = load<uint16_t>(f + 6);
  const uint64_t fatSize = load<uint64_t>(f + 8);
  if (headerSize < 16 || fatSize > (1ull << 32)) return;
  const char* p = f + headerSize;
  const char* end = p + fatSize;
  while (p + 16 <= end) {
    const uint16_t kind = load<uint16_t>(p);
    const uint32_t entryHeader = load<uint32_t>(p + 4);
    const uint64_t payload = load<uint64_t>(p + 8);
    if (entryHeader < 16 || payload > fatSize) return;
    const char* data = p + entryHeader;
    if (data + payload > end) return;
    if (kind == 2 && payload >= 4 && std::memcmp(data, ELFMAG, SELFMAG) == 0) parseElf(data, payload, out);
    p = data + payload;
  }
}

// PTX text: each .entry's parameter layout from its declaration, e.g.
//   .visible .entry k(.param .u64 p, .param .align 8 .b8 s[16], .param .u64 .ptr .global .align 1 q)
// Offsets as the ABI lays them out: each parameter at its alignment (its .align, else its
// element's size; an .align after .ptr is the pointee's). Comments are dropped first. Anything
// not understood (a type or qualifier not listed here, a parameter list over the 32764 bytes a
// launch may pass, a second name) drops every entry of the text (launches then go on without a
// layout, as before), so a misread layout never makes a launch copy the wrong bytes.
// All of text is a decimal number (at most 9 digits).
bool wholeNumber(const std::string& text, uint64_t* out) {
  if (text.empty() || text.size() > 9) return false;
  uint64_t v = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  *out = v;
  return true;
}

bool parsePtx(const char* p, size_t n, ImageInfo* out) {
  constexpr uint64_t kMaxParamBytes = 32764;  // CUDA 12.1+ on Volta and later (4 KiB before)
  const std::string raw(p, n ? strnlen(p, n) : std::strlen(p));
  std::string text;  // raw without comments (each replaced by a space)
  text.reserve(raw.size());
  for (size_t i = 0; i < raw.size();) {
    if (raw.compare(i, 2, "//") == 0) {
      i = raw.find('\n', i);
      if (i == std::string::npos) break;
    } else if (raw.compare(i, 2, "/*") == 0) {
      const size_t end = raw.find("*/", i + 2);
      if (end == std::string::npos) return false;
      text += ' ';
      i = end + 2;
    } else {
      text += raw[i++];
    }
  }
  std::map<std::string, std::vector<ParamInfo>> kernels;
  const auto isIdent = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '$' || c == '.'; };
  const auto skipSpace = [&](size_t i) {
    while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
    return i;
  };
  for (size_t at = text.find(".entry"); at != std::string::npos; at = text.find(".entry", at + 6)) {
    if ((at > 0 && isIdent(text[at - 1])) || (at + 6 < text.size() && isIdent(text[at + 6]))) continue;
    size_t i = skipSpace(at + 6);
    const size_t nameStart = i;
    while (i < text.size() && isIdent(text[i]) && text[i] != '.') ++i;
    const std::string name = text.substr(nameStart, i - nameStart);
    if (name.empty()) return false;
    i = skipSpace(i);
    std::vector<ParamInfo> params;
    if (i < text.size() && text[i] == '(') {
      const size_t close = text.find(')', i);
      if (close == std::string::npos) return false;
      const std::string list = text.substr(i + 1, close - i - 1);
      uint64_t offset = 0;
      size_t from = 0;
      while (from <= list.size()) {
        size_t comma = list.find(',', from);
        if (comma == std::string::npos) comma = list.size();
        std::istringstream in(list.substr(from, comma - from));
        from = comma + 1;
        std::vector<std::string> words;
        for (std::string w; in >> w;) words.push_back(w);
        if (words.empty()) {
          if (comma == list.size() && params.empty()) break;  // "()"
          return false;
        }
        if (words[0] != ".param") return false;
        uint64_t align = 0, elem = 0, count = 1;
        bool ptr = false, named = false;
        for (size_t w = 1; w < words.size(); ++w) {
          const std::string& t = words[w];
          if (named) return false;  // the name comes last
          if (t == ".align") {
            if (++w >= words.size()) return false;
            uint64_t a = 0;
            if (!wholeNumber(words[w], &a)) return false;
            if (!ptr) align = a;
          } else if (t == ".ptr") {
            ptr = true;
          } else if (t.size() >= 3 && t[0] == '.' && (t[1] == 'u' || t[1] == 's' || t[1] == 'b' || t[1] == 'f') &&
                     std::isdigit(static_cast<unsigned char>(t[2]))) {
            uint64_t bits = 0;  // the whole rest: ".f16x2" and the like are not read as their prefix
            if (!wholeNumber(t.substr(2), &bits) || (bits != 8 && bits != 16 && bits != 32 && bits != 64)) return false;
            elem = bits / 8;
          } else if (t == ".global" || t == ".const" || t == ".local" || t == ".shared") {
          } else if (t[0] == '.') {
            return false;  // a type or qualifier not known here (.texref, .samplerref...)
          } else {  // the name, perhaps with [count]
            named = true;
            const size_t b = t.find('[');
            if (b != std::string::npos) {  // exactly one [count] at the end
              if (t.back() != ']' || !wholeNumber(t.substr(b + 1, t.size() - b - 2), &count) || count == 0 ||
                  count > kMaxParamBytes)
                return false;
            } else if (t.find(']') != std::string::npos) {
              return false;
            }
          }
        }
        if (elem == 0 || !named) return false;
        if (align == 0) align = elem;
        if ((align & (align - 1)) != 0 || align > 256) return false;
        offset = (offset + align - 1) / align * align;
        if (offset + elem * count > kMaxParamBytes) return false;
        params.push_back(ParamInfo{static_cast<uint32_t>(offset), static_cast<uint32_t>(elem * count)});
        offset += elem * count;
        if (comma == list.size()) break;
      }
    }
    kernels[name] = std::move(params);
  }
  for (auto& [name, params] : kernels) out->kernels[name] = std::move(params);
  return true;
}

}  // namespace

void parseImage(const void* image, size_t size, ImageInfo* out) {
  if (!image) return;
  const char* p = static_cast<const char*>(image);
  const uint32_t magic = load<uint32_t>(p);
  if (magic == kWrapperMagic) {
    const void* data = load<const void*>(p + 8);
    if (data && load<uint32_t>(static_cast<const char*>(data)) == kFatbinMagic)
      parseFatbin(static_cast<const char*>(data), out);
  } else if (magic == kFatbinMagic) {
    parseFatbin(p, out);
  } else if (std::memcmp(p, ELFMAG, SELFMAG) == 0) {
    // A bare cubin: its size is in its own header when the caller does not know it.
    const auto eh = load<Elf64_Ehdr>(p);
    const size_t n = size ? size : eh.e_shoff + static_cast<size_t>(eh.e_shnum) * eh.e_shentsize;
    parseElf(p, n, out);
  } else if (std::isprint(static_cast<unsigned char>(p[0])) || std::isspace(static_cast<unsigned char>(p[0]))) {
    // PTX text (NUL-terminated, as the driver takes it); only where it declares kernels (.entry).
    ImageInfo ptx;
    if (parsePtx(p, size, &ptx)) out->kernels.insert(ptx.kernels.begin(), ptx.kernels.end());
  }
}

}  // namespace simgpu
