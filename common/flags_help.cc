#include "common/flags_help.h"

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "gflags/gflags.h"

DECLARE_bool(help);
DECLARE_bool(helpshort);

namespace ferry {

void ParseFlagsWithOwnHelp(int* argc, char*** argv, const char* own_file) {
  bool dash_h = false;  // gflags has no -h; people type it
  for (int i = 1; i < *argc; ++i) dash_h |= std::string((*argv)[i]) == "-h";
  if (!dash_h) gflags::ParseCommandLineNonHelpFlags(argc, argv, /*remove_flags=*/true);
  if (dash_h || FLAGS_help || FLAGS_helpshort) {
    std::cout << gflags::ProgramUsage() << "\n\nflags:\n";
    std::vector<gflags::CommandLineFlagInfo> flags;
    gflags::GetAllFlags(&flags);
    for (const gflags::CommandLineFlagInfo& f : flags) {
      if (f.filename != own_file) continue;
      std::cout << "  --" << f.name << "  " << f.description << " (default: "
                << (f.default_value.empty() ? "\"\"" : f.default_value) << ")\n";
    }
    std::cout << "\nlogging: glog's --v=N (verbosity); --helpfull lists every "
                 "flag of every library\n";
    std::exit(0);
  }
  gflags::HandleCommandLineHelpFlags();  // --version, --helpfull, ...
}

}  // namespace ferry
