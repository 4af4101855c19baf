// --help that lists a binary's own flags, not the hundred that glog and
// gflags bring along. Every ferry binary parses its flags with this.
#ifndef FERRY_COMMON_FLAGS_HELP_H_
#define FERRY_COMMON_FLAGS_HELP_H_

namespace ferry {

// Parses the command line (gflags, removing the flags it took). On --help,
// --helpshort or -h prints the usage message (gflags::SetUsageMessage) and the
// flags defined in `own_file` (pass __FILE__ from the file that defines
// them, usually the one with main), each with its default, and exits 0;
// --version and the other gflags help flags behave as usual.
void ParseFlagsWithOwnHelp(int* argc, char*** argv, const char* own_file);

}  // namespace ferry

#endif  // FERRY_COMMON_FLAGS_HELP_H_
